"""Tensor (and sequence) parallelism of the whole GPT against the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import assert_matches_reference, max_state_diff, ranked_run, reference_run, rel_diff, tiny_run
from tests.margins import within

STEPS = 6  # AdamW steps against one process (the margins in docs were measured over 10)


def reference(dtype: str = "float32", dropout: float = 0.0) -> dict:
    return reference_run(STEPS, dtype=dtype, dropout=dropout)


def _job(**kwargs) -> dict:
    return ranked_run(steps=STEPS, **kwargs)


def _replicas_identical(got: list[dict], tp: int) -> None:
    """Replicated parameters (norms) hold the same numbers on every tp rank of a dp slot."""
    for start in range(0, len(got), tp):
        first = got[start]["local"]
        for other in got[start + 1: start + tp]:
            for name, value in first.items():
                if "norm" in name:
                    assert torch.equal(value, other["local"][name]), name


@pytest.mark.parametrize("dp,tp,sequence_parallel", [(1, 2, False), (1, 2, True), (2, 2, True), (1, 4, True)])
def test_tp_matches_single_process(pools, dp, tp, sequence_parallel):
    got = pools(dp * tp).run(_job, dp=dp, tp=tp, sequence_parallel=sequence_parallel, micro_batch=4)
    ref = reference()
    assert_matches_reference(got, ref)  # grad norm: each parameter counted once; state gathered over tp
    _replicas_identical(got, tp)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_with_recompute(pools, sequence_parallel):
    got = pools(2).run(_job, dp=1, tp=2, sequence_parallel=sequence_parallel, micro_batch=8, recompute=True)
    within(rel_diff(got[0]["losses"], reference()["losses"]), 1e-5, "loss")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp_with_zero(pools, zero):
    got = pools(4).run(_job, dp=2, tp=2, sequence_parallel=zero != 2, zero=zero, micro_batch=4)
    ref = reference()
    assert_matches_reference(got, ref)
    _replicas_identical(got, 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_float64_is_exact(pools, sequence_parallel):
    got = pools(4).run(_job, dp=2, tp=2, sequence_parallel=sequence_parallel, micro_batch=4, dtype="float64")
    ref = reference("float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-12, "loss (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-11, "weights (float64)")


def test_dropout_is_layout_free(pools):
    """Dropout 0.1 on attention probabilities (heads split over tp) and residual outputs (sequence
    split under SP): the masks are keyed by logical position, so every layout draws the single
    device's masks; recomputation redraws the same."""
    ref = reference("float64", dropout=0.1)
    assert ref["losses"] != reference("float64")["losses"]  # dropout is on
    steps = 6
    for dp, tp, sp, recompute in [(2, 2, True, True), (2, 2, False, False), (4, 1, False, False)]:
        got = pools(dp * tp).run(tiny_run, dp=dp, tp=tp, sequence_parallel=sp, micro_batch=2, dtype="float64",
                                 dropout=0.1, recompute=recompute, steps=steps)
        within(rel_diff(got[0]["losses"], ref["losses"][:steps]), 1e-12, f"loss (float64) {(dp, tp, sp)}")


def _mlp_job(dp: int | None, tp: int) -> dict:
    """Any model of nn.Linear given a plan: an MLP regression in float64, 5 SGD-momentum steps."""
    import paratrain
    from tests.helpers import regression_rows, squared_error

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dp, tp=tp))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                torch.nn.Linear(8, 4)).double()
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                   options=paratrain.EngineOptions(grad_clip=0.5),
                                   recipe=paratrain.recipe_for(model, tp_plan={"0": "column", "2": "row",
                                                                               "3": "column_gather"}))
    losses = [engine.train_step(regression_rows(ctx, 8, 4), squared_error) for _ in range(5)]
    return {"losses": losses, "model": engine.state_dict()["model"]}


def test_plan_applies_to_any_linear_model(pools):
    ref = _mlp_job(None, 1)
    for dp, tp in ((2, 2),):
        got = pools(dp * tp).run(_mlp_job, dp, tp)[0]
        within(rel_diff(got["losses"], ref["losses"]), 1e-12, "loss (float64)")
        within(max_state_diff(got["model"], ref["model"]), 1e-12, "weights (float64)")


def _count_step(sequence_parallel: bool) -> list[tuple[str, int]]:
    import paratrain
    from paratrain.comm import CollectiveCounter
    from tests.helpers import TINY

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, tp=dist.get_world_size(), sequence_parallel=sequence_parallel))
    model = paratrain.build_gpt(TINY, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(grad_clip=1.0))
    x = torch.randint(0, 256, (4, TINY.seq_len))
    with CollectiveCounter() as counter:
        engine.train_step((x, x.roll(-1, 1)), paratrain.lm_loss)
    return counter.calls


def test_communication_follows_the_megatron_formula(pools):
    """Per block 2 all-reduces of b x s x h in forward and 2 in backward (Shoeybi et al. 2019), plus
    the embedding's forward and the head's input-gradient all-reduce, plus the loss's three [b x s]
    all-reduces and the norm's scalar. Sequence parallelism: each all-reduce becomes an all-gather
    and a reduce-scatter of the same tensor (gloo's reduce-scatter is issued as an all-reduce), plus
    one [h] all-reduce per replicated norm weight (and the embedding's backward becomes an all-gather
    where it was free)."""
    from tests.helpers import TINY

    b, s, h, layers = 4, TINY.seq_len, TINY.d_model, TINY.n_layer
    calls = pools(2).run(_count_step, False)[0]
    assert sorted(calls) == sorted([("all_reduce", b * s * h)] * (4 * layers + 2) + [("all_reduce", b * s)] * 3
                                   + [("all_reduce", 1)])
    calls = pools(2).run(_count_step, True)[0]
    # all-gathers: column inputs (forward: 2 per block and the head; again in backward, since only
    # the sequence slice is saved), row output gradients (backward), the embedding's output gradient
    # (backward of its reduce-scatter)
    assert calls.count(("all_gather", b * s * h)) == 4 * layers + 2 + 2 * layers + 1
    assert calls.count(("all_reduce", b * s * h)) == 4 * layers + 2  # the reduce-scatters
    assert calls.count(("all_reduce", h)) == 2 * layers + 1  # replicated norm weights' gradients
    assert len(calls) == 2 * (4 * layers + 2) + 2 * (2 * layers + 1) + 3 + 1


def _activation_bytes(tp: int, sequence_parallel: bool) -> int:
    import paratrain
    from paratrain.config import preset
    from paratrain.memory import saved_activations

    config = preset("tiny", seq_len=64, n_layer=2, d_model=128)
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dist.get_world_size() // tp, tp=tp,
                                                  sequence_parallel=sequence_parallel))
    model = paratrain.build_gpt(config, seed=0)
    paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randint(0, 256, (4, 64))
    with saved_activations(model) as saved:
        paratrain.lm_loss(model, (x, x.roll(-1, 1)))
    return saved.bytes


def test_sequence_parallel_splits_every_activation(pools):
    """What autograd saves for backward, per rank: tensor parallelism alone splits what lies inside
    the attention and the MLP; with sequence parallelism the norms' and residuals' activations are
    split too, and the column layers keep their input's sequence slice (re-gathered in backward),
    so the whole comes to the single device's activations / tp (Korthikanti et al. 2022, table 2)."""
    single = pools(2).run(_activation_bytes, 1, False)[0]
    plain = pools(2).run(_activation_bytes, 2, False)[0]
    split = pools(2).run(_activation_bytes, 2, True)[0]
    assert split < plain < single
    assert split == pytest.approx(single / 2, rel=0.02)
