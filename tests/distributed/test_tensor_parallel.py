"""Tensor (and sequence) parallelism of the whole GPT against the single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import max_state_diff, rel_diff, tiny_run

STEPS = 10
_cache: dict = {}


def reference(dtype: str = "float32", dropout: float = 0.0) -> dict:
    key = (dtype, dropout)
    if key not in _cache:
        _cache[key] = tiny_run(dp=None, micro_batch=None, steps=STEPS, dtype=dtype, dropout=dropout)
    return _cache[key]


def _job(**kwargs) -> dict:
    result = tiny_run(steps=STEPS, **kwargs)
    result["rank"] = dist.get_rank()
    return result


def _replicas_identical(got: list[dict], tp: int) -> None:
    """Replicated parameters (norms) hold the same numbers on every tp rank of a dp slot."""
    for start in range(0, len(got), tp):
        first = got[start]["local"]
        for other in got[start + 1: start + tp]:
            for name, value in first.items():
                if "norm" in name:
                    assert torch.equal(value, other["local"][name]), name


@pytest.mark.parametrize("dp,tp", [(1, 2), (1, 4), (2, 2)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_matches_single_process(pools, dp, tp, sequence_parallel):
    got = pools(dp * tp).run(_job, dp=dp, tp=tp, sequence_parallel=sequence_parallel, micro_batch=4)
    ref = reference()
    for rank_result in got:
        assert rel_diff(rank_result["losses"], ref["losses"]) <= 1e-5
        assert rel_diff(rank_result["grad_norms"], ref["grad_norms"]) <= 1e-5  # each parameter counted once
    assert max_state_diff(got[0]["model"], ref["model"]) < 1e-4  # whole, gathered over tp
    assert max_state_diff(got[0]["optimizer"], ref["optimizer"]) < 1e-4
    _replicas_identical(got, tp)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_with_recompute(pools, sequence_parallel):
    got = pools(2).run(_job, dp=1, tp=2, sequence_parallel=sequence_parallel, micro_batch=8, recompute=True)
    assert rel_diff(got[0]["losses"], reference()["losses"]) <= 1e-5


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp_with_zero(pools, zero):
    got = pools(4).run(_job, dp=2, tp=2, sequence_parallel=zero != 2, zero=zero, micro_batch=4)
    ref = reference()
    for rank_result in got:
        assert rel_diff(rank_result["losses"], ref["losses"]) <= 1e-5
        assert rel_diff(rank_result["grad_norms"], ref["grad_norms"]) <= 1e-5
    assert max_state_diff(got[0]["model"], ref["model"]) < 1e-4
    assert max_state_diff(got[0]["optimizer"], ref["optimizer"]) < 1e-4
    _replicas_identical(got, 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_float64_is_exact(pools, sequence_parallel):
    got = pools(4).run(_job, dp=2, tp=2, sequence_parallel=sequence_parallel, micro_batch=4, dtype="float64")
    ref = reference("float64")
    assert rel_diff(got[0]["losses"], ref["losses"]) <= 1e-12
    assert max_state_diff(got[0]["model"], ref["model"]) <= 1e-11


def test_dropout_is_layout_free(pools):
    """Dropout 0.1 on attention probabilities (heads split over tp) and residual outputs (sequence
    split under SP): the masks are keyed by logical position, so every layout draws the single
    device's masks; recomputation redraws the same."""
    ref = reference("float64", dropout=0.1)
    assert ref["losses"] != reference("float64")["losses"]  # dropout is on
    for dp, tp, sp, recompute in [(1, 2, True, False), (2, 2, True, True), (2, 2, False, False), (4, 1, False, False)]:
        got = pools(dp * tp).run(_job, dp=dp, tp=tp, sequence_parallel=sp, micro_batch=2, dtype="float64",
                                 dropout=0.1, recompute=recompute)
        assert rel_diff(got[0]["losses"], ref["losses"]) <= 1e-12, (dp, tp, sp)


def _half_job(**kwargs) -> dict:
    return tiny_run(steps=STEPS // 2, return_state=True, **kwargs)


def test_checkpoint_moves_between_tp_and_dp(pools):
    """A tp = 2 state is whole tensors by name: dp = 2, and dp 2 x tp 2 with ZeRO-2 and sequence
    parallelism, continue from it as the single process would."""
    ref = reference("float64")
    first = pools(2).run(_half_job, dp=1, tp=2, micro_batch=4, dtype="float64")[0]["state"]
    assert first["model"]["tok_emb.weight"].shape == (256, 64)  # whole, not a tp slice
    for layout in ({"dp": 2}, {"dp": 2, "tp": 2, "zero": 2, "sequence_parallel": True}):
        world = layout["dp"] * layout.get("tp", 1)
        got = pools(world).run(_half_job, micro_batch=4, dtype="float64", start=first, start_step=STEPS // 2,
                               **layout)
        assert rel_diff(got[0]["losses"], ref["losses"][STEPS // 2:]) <= 1e-12, layout


def _mlp_job(dp: int | None, tp: int) -> dict:
    """Any model of nn.Linear given a plan: an MLP regression in float64, 5 SGD-momentum steps."""
    import paratrain
    from tests.helpers import regression_rows, squared_error

    ctx = paratrain.init(paratrain.ParallelConfig(dp=dp, tp=tp))
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                torch.nn.Linear(8, 4)).double()
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                   grad_clip=0.5, tp_plan={"0": "column", "2": "row", "3": "column_gather"})
    losses = [engine.train_step(regression_rows(ctx, 8, 4), squared_error) for _ in range(5)]
    return {"losses": losses, "model": engine.state_dict()["model"]}


def test_plan_applies_to_any_linear_model(pools):
    ref = _mlp_job(None, 1)
    for dp, tp in ((1, 2), (2, 2)):
        got = pools(dp * tp).run(_mlp_job, dp, tp)[0]
        assert rel_diff(got["losses"], ref["losses"]) <= 1e-12
        assert max_state_diff(got["model"], ref["model"]) <= 1e-12
