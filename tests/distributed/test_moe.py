"""Mixture-of-Experts under every layout against the single-process MoE GPT (the oracle): the loss
(cross-entropy + auxiliary losses), gradient norms, trained weights and routing statistics.

tiny-moe: 4 experts, top-2, a MoE layer in blocks 1 and 3, a shared expert; capacity factor 1.0 so
that assignments are dropped (per sequence: the same ones in every layout)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_matches_reference, max_state_diff, ranked_run, reference_run, rel_diff
from tests.margins import within

STEPS = 8
MOE = (("capacity_factor", 1.0),)


def _job(**kwargs) -> dict:
    return ranked_run(steps=STEPS, model="tiny-moe", overrides=MOE, **kwargs)


def reference(dtype: str = "float32") -> dict:
    return reference_run(STEPS, dtype=dtype, model="tiny-moe", overrides=MOE)


def same_routing(got: dict, ref: dict) -> None:
    """Which assignments ran and were dropped: integers, equal in every layout (float64)."""
    for mine, theirs in zip(got["routing"], ref["routing"], strict=True):
        for key in ("expert_tokens_min", "expert_tokens_max", "moe_dropped_fraction"):
            assert mine[key] == theirs[key], key
    assert ref["routing"][0]["moe_dropped_fraction"] > 0  # capacity does drop


@pytest.mark.parametrize("layout", [
    dict(dp=2, micro_batch=2),                          # dp 2 and accumulation 4
    dict(dp=2, micro_batch=4, zero=2, recompute=True),  # ZeRO-2, blocks recomputed
    dict(dp=2, micro_batch=8, zero=3),
    dict(dp=1, tp=2, micro_batch=8),                    # attention split, experts replicated over tp
    dict(dp=1, pp=2, micro_batch=2),                    # a MoE layer on each stage
], ids=["dp2-accum", "zero2-recompute", "zero3", "tp2", "pp2"])
def test_float64_layouts_equal_the_single_process(pools, layout):
    world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1)
    got = pools(world).run(_job, dtype="float64", **layout)
    ref = reference("float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-12, "MoE loss (float64)")
    within(rel_diff(got[0]["grad_norms"], ref["grad_norms"]), 1e-12, "MoE grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "MoE weights (float64)")
    same_routing(got[0], ref)


def test_float32_dp_by_tp_with_zero1(pools):
    got = pools(4).run(_job, dp=2, tp=2, zero=1, micro_batch=4)
    assert_matches_reference(got, reference())
