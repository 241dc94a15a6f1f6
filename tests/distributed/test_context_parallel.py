"""Context parallelism of the whole GPT against the single-process reference: each sequence split over
cp ranks (balanced causal chunks), attention by ring or Ulysses, gradients reduced over dp x cp."""

from __future__ import annotations

import pytest

from tests.helpers import assert_matches_reference, max_state_diff, ranked_run, reference_run, rel_diff, tiny_run
from tests.margins import within

STEPS = 10


def _job(**kwargs) -> dict:
    return ranked_run(**{"steps": STEPS, **kwargs})


@pytest.mark.parametrize("cp,mode", [(2, "ring"), (2, "ulysses"), (4, "ring"), (4, "ulysses")])
def test_cp_float64_is_exact(pools, cp, mode):
    """10 AdamW steps of the tiny GPT in float64: the loss and grad norm of one process at every step."""
    got = pools(cp).run(_job, dp=1, cp=cp, cp_mode=mode, micro_batch=8, dtype="float64")
    ref = reference_run(STEPS, dtype="float64")
    for rank in got:
        within(rel_diff(rank["losses"], ref["losses"]), 1e-12, "loss (float64)")
        within(rel_diff(rank["grad_norms"], ref["grad_norms"]), 1e-12, "grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-11, "weights (float64)")


@pytest.mark.parametrize("dp,cp,zero,mode", [(2, 2, 0, "ring"), (1, 2, 1, "ring"), (1, 2, 2, "ulysses"),
                                             (2, 2, 3, "ring")])
def test_cp_composes_with_dp_and_zero(pools, dp, cp, zero, mode):
    """float32, the parity suite's bounds: dp x cp, and ZeRO sharding over dp x cp."""
    got = pools(dp * cp).run(_job, dp=dp, cp=cp, cp_mode=mode, zero=zero, micro_batch=4)
    assert_matches_reference(got, reference_run(STEPS))


def test_a_cp_checkpoint_resumes_under_another_cp_degree(pools, tmp_path):
    """cp splits no state: a sharded checkpoint written under dp2 x cp2 with ZeRO-2 (each rank a shard of
    dp x cp) continues under cp 4 and on one process as the uninterrupted run does (float64)."""
    root = str(tmp_path / "ckpt")
    pools(4).run(_job, dp=2, cp=2, zero=2, micro_batch=4, dtype="float64", steps=STEPS // 2, save_sharded=root)
    ref = reference_run(STEPS, dtype="float64")["losses"][STEPS // 2:]
    got = pools(4).run(_job, dp=1, cp=4, micro_batch=8, dtype="float64", steps=STEPS // 2, start_step=STEPS // 2,
                       load_sharded=root)
    within(rel_diff(got[0]["losses"], ref), 1e-12, "loss after resuming dp2 x cp2 -> cp4 (float64)")
    one = tiny_run(dp=None, micro_batch=None, dtype="float64", steps=STEPS // 2, start_step=STEPS // 2,
                     load_sharded=root)
    within(rel_diff(one["losses"], ref), 1e-12, "loss after resuming dp2 x cp2 -> one process (float64)")


@pytest.mark.parametrize("mode,sp", [("ring", True), ("ulysses", False)])
def test_cp_composes_with_tensor_parallelism(pools, mode, sp):
    """cp2 x tp2 (tp splits the heads, cp the sequence; sequence parallelism splits this rank's part of the
    sequence again over tp), float64: one process's loss, grad norm and weights."""
    got = pools(4).run(_job, dp=1, cp=2, tp=2, sequence_parallel=sp, cp_mode=mode, micro_batch=8, dtype="float64")
    ref = reference_run(STEPS, dtype="float64")
    for rank in got:
        within(rel_diff(rank["losses"], ref["losses"]), 1e-12, "loss (float64)")
        within(rel_diff(rank["grad_norms"], ref["grad_norms"]), 1e-12, "grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-11, "weights (float64)")
