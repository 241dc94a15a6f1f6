"""Pipeline parallelism (every schedule) and the 3D hybrid against the single-process reference."""

from __future__ import annotations

import pytest

from paratrain.pipeline import program
from paratrain.pipeline.timeline import replay
from tests.helpers import assert_matches_reference, max_state_diff, ranked_run, reference_run, rel_diff, tiny_run
from tests.margins import within

STEPS = 6  # AdamW steps against one process (the margins in docs were measured over 10)


def reference(dtype: str = "float32", n_layer: int = 4) -> dict:
    return reference_run(STEPS, dtype=dtype, n_layer=n_layer)


def _job(**kwargs) -> dict:
    return ranked_run(steps=STEPS, **kwargs)


@pytest.mark.parametrize("pp,schedule", [(2, "gpipe"), (2, "1f1b"), (2, "interleaved"), (2, "zero-bubble"),
                                         (2, "zb-h1"), (2, "zb-v"), (2, "dualpipev"), (4, "1f1b"), (4, "interleaved")])
def test_every_schedule_matches_single_process(pools, pp, schedule):
    """8 micro-batches of 2 samples; interleaved, zb-v and dualpipev: 2 chunks per rank (6 blocks, so 8 layers for
    pp 4)."""
    v = 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1
    n_layer = 6 if pp * v > 6 else 4
    got = pools(pp).run(_job, dp=1, pp=pp, schedule=schedule, virtual_stages=v, micro_batch=2, n_layer=n_layer)
    ref = reference(n_layer=n_layer)
    assert_matches_reference(got, ref)  # the whole model, gathered over stages
    # the last step's timeline: every compute action of the program, in its order, and the replay
    times = [r["timeline"] for r in got]
    for rank, t in enumerate(times):
        ran = [(kind, chunk, mb) for kind, chunk, mb, *_ in t.events if not kind.startswith("WAIT")]
        assert ran == [(a.kind, a.chunk, a.mb) for a in program(schedule, pp, 8, rank, v) if a.kind in ("F", "B", "I", "W")]
    assert 0 < replay(times, schedule, microbatches=8, chunks=v).makespan <= max(t.total for t in times)


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble", "zb-h1", "zb-v", "dualpipev"])
def test_pipeline_float64_is_exact(pools, schedule):
    """pp 4 (every schedule at pp 4 is covered here or above), the tiny GPT's tied embedding on the first and last
    stage (zb-v: both on rank 0, the first and the last chunk; 8 blocks for its 8 chunks): float64 leaves only
    rounding."""
    n_layer = 6 if schedule in ("zb-v", "dualpipev") else 4
    got = pools(4).run(_job, dp=1, pp=4, schedule=schedule, micro_batch=2, dtype="float64", n_layer=n_layer)
    ref = reference("float64", n_layer=n_layer)
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-13, "loss (float64)")
    within(rel_diff(got[0]["grad_norms"], ref["grad_norms"]), 1e-12, "grad norm (float64)")  # each parameter once
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "weights (float64)")


@pytest.mark.parametrize("zero,sequence_parallel,recompute,schedule", [(1, True, True, "zb-h1"),
                                                                       (2, False, False, "1f1b"),
                                                                       (1, False, False, "zb-v"),
                                                                       (1, True, False, "dualpipev")])
def test_3d_hybrid_matches_single_process(pools, zero, sequence_parallel, recompute, schedule):
    """dp 2 x tp 2 x pp 2 on 8 processes, with ZeRO over dp (DeepSpeed refuses ZeRO-2 with pipelining),
    sequence parallelism and recomputation; ZB-H1's, ZB-V's and DualPipeV's weight-gradient passes over tp slices and
    ZeRO-1's buckets (the V: the tied embedding and head both on pipeline rank 0; DualPipeV: 8 micro-batches of 1)."""
    got = pools(8).run(_job, dp=2, tp=2, pp=2, zero=zero, sequence_parallel=sequence_parallel,
                       recompute=recompute, micro_batch=1 if schedule == "dualpipev" else 2, schedule=schedule)
    ref = reference()
    assert_matches_reference(got, ref)


def test_a_stage_of_only_the_head_reduces_the_norm_alike(pools):
    """tp 2 x pp 2 cut after the last block (pp_split 5): stage 1 holds only the final norm (a replica)
    and the tied head's copy (counted by stage 0), no tp slice. It used to reduce one part of the
    gradient norm over pp where stage 0 reduced two, pairing the wrong collectives; every stage now
    reduces both parts, in one order, and the run is the single process's (float64)."""
    got = pools(4).run(_job, dp=1, tp=2, pp=2, pp_split=(5,), micro_batch=4, dtype="float64")
    ref = reference("float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-13, "loss (float64)")
    within(rel_diff(got[0]["grad_norms"], ref["grad_norms"]), 1e-12, "grad norm (float64)")


def _stage_ranges(pp_layout: str, schedule: str) -> dict[int, tuple[int, int]]:
    """The layers of this rank's chunks when the engine cuts the tiny GPT by a --pp-layout (paratrain.init's
    Python door: no run checks before it)."""
    import torch

    import paratrain

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(pp=2, schedule=schedule, pp_layout=pp_layout))
    engine = paratrain.parallelize(paratrain.build_gpt(paratrain.config.preset("tiny", seq_len=32), seed=0), ctx,
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert engine.parts.pipeline is not None
    return dict(engine.parts.pipeline.stage.ranges)


def test_the_engine_cuts_the_stages_as_a_pp_layout_writes_them(pools):
    """--pp-layout through the engine: "E|t*4L" (the embedding alone) and, two chunks a rank in a V, "Et|t|t|tL"
    (rank 0 the first and the last chunk)."""
    assert pools(2).run(_stage_ranges, "E|t*4L", "1f1b") == [{0: (0, 1)}, {1: (1, 6)}]
    assert pools(2).run(_stage_ranges, "Et|t|t|tL", "zb-v") == [{0: (0, 2), 3: (4, 6)}, {1: (2, 3), 2: (3, 4)}]


def _half_job(**kwargs) -> dict:
    return tiny_run(steps=STEPS // 2, return_state=True, **kwargs)


def test_checkpoint_moves_between_pipeline_and_other_layouts(pools):
    """A pp = 2 state is the whole model by name (the tied head copy folded into the embedding):
    one process continues it, and pp 4 continues a dp 2 one."""
    ref = reference("float64")
    first = pools(2).run(_half_job, dp=1, pp=2, micro_batch=4, dtype="float64")[0]["state"]
    assert "head.weight" not in first["model"] and first["model"]["tok_emb.weight"].shape == (256, 64)
    single = tiny_run(micro_batch=None, dp=None, dtype="float64", start=first, start_step=STEPS // 2,
                      steps=STEPS // 2)
    within(rel_diff(single["losses"], ref["losses"][STEPS // 2:]), 1e-12, "loss after pp 2 -> 1 (float64)")
    data_parallel = pools(2).run(_half_job, dp=2, micro_batch=4, dtype="float64")[0]["state"]
    got = pools(4).run(_half_job, dp=1, pp=4, micro_batch=2, dtype="float64", start=data_parallel,
                       start_step=STEPS // 2)
    within(rel_diff(got[0]["losses"], ref["losses"][STEPS // 2:]), 1e-12, "loss after dp 2 -> pp 4 (float64)")


def _every_other_position(logits, targets):
    """A loss with its own rule for which positions count: only even positions (a count that is not
    the number of non-ignored targets)."""
    import torch.nn.functional as F

    kept = targets[:, ::2]
    total = F.cross_entropy(logits[:, ::2].reshape(-1, logits.shape[-1]), kept.reshape(-1), reduction="sum")
    return total, kept.numel()


def _custom_loss_run(pp: int) -> list[float]:
    import torch

    import paratrain
    from paratrain.data import GlobalBatchLoader, load_source
    from tests.helpers import TINY

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, pp=pp))
    model = paratrain.build_gpt(TINY, seed=3, dtype=torch.float64)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=4),
                                   recipe=paratrain.recipe_for(
                                       model, pipeline_loss=_every_other_position if pp > 1 else None))
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=TINY.seq_len, global_batch=8, dp=1, dp_index=0,
                               seed=3)

    def loss_fn(model, micro):
        inputs, targets = micro
        return _every_other_position(model(inputs), targets)

    losses = []
    for _ in range(3):
        losses.append(engine.train_step(loader.next(), loss_fn))
        assert engine.last.tokens == 8 * TINY.seq_len // 2  # the loss's own count, not the targets'
    return losses


def test_pipeline_normalises_by_the_loss_functions_own_count(pools):
    """A custom loss counting half the positions: under pp the step divides by that count (it once
    divided by the number of targets under pp only, halving the loss and the update)."""
    ref = _custom_loss_run(1)
    got = pools(2).run(_custom_loss_run, 2)
    for losses in got:
        within(rel_diff(losses, ref), 1e-13, "loss (float64)")
