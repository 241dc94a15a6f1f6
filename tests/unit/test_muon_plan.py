"""The planner's Muon exchange: its own plan per rank (tests/distributed/test_muon.py checks it against the engine's,
rank by rank) and the estimate the search ranks its many layouts by, against that plan."""

from __future__ import annotations

import pytest

from paratrain.config import PRESETS
from paratrain.planner.layout import Layout
from paratrain.planner.optimizer import exchange_figures, layout_exchange
from paratrain.planner.settings import StepSettings

MUON = StepSettings(optimizer="muon")


@pytest.mark.parametrize("model, layout, bucket_mb", [
    ("tiny", dict(dp=2), 0.05), ("tiny", dict(dp=4, zero=1), 0.05), ("tiny", dict(dp=4, zero=3), 0.05),
    ("tiny", dict(tp=2), 0.05), ("tiny", dict(dp=2, tp=2, zero=1), 0.05), ("tiny", dict(pp=2, dp=2), 0.05),
    ("tiny", dict(tp=4, tp_mode="2d"), 0.05), ("gpt2", dict(dp=8, zero=1), 25.0),
    ("gpt2", dict(dp=4, tp=2, zero=2), 25.0), ("gpt2", dict(dp=2, tp=2, pp=2, zero=1), 25.0),
    ("gpt2", dict(dp=16, zero=3), 25.0),
])
def test_the_search_estimate_is_near_the_plan(model, layout, bucket_mb):
    """Measured (estimate / plan): peak 0.94-1.13, busiest owner's FLOPs 0.82-1.27, elements moved 0.62-1.69
    (the estimate puts the busiest owner in every bucket); bounds 0.9-1.25, 0.75-1.35, 0.5-2."""
    settings = StepSettings(optimizer="muon", bucket_mb=bucket_mb)
    exact = exchange_figures(PRESETS[model], Layout.of(**layout), settings, exact=True)
    guess = exchange_figures(PRESETS[model], Layout.of(**layout), settings, exact=False)
    assert exact.exact and not guess.exact
    assert 0.9 <= max(guess.peak.values()) / max(exact.peak.values()) <= 1.25
    assert 0.75 <= guess.owner_flops / exact.owner_flops <= 1.35
    assert 0.5 <= guess.moved / exact.moved <= 2.0


def test_owners_balance_to_one_largest_matrix_on_a_thousand_ranks():
    """GPT-3 175B as dp 128 x tp 8 under ZeRO-3: 384 matrices over 1,024 ranks (some own none), every element once
    (the plan asserts the parts cover each unit), the owners' loads within one largest matrix."""
    plan = layout_exchange(PRESETS["gpt3-175b"], Layout.of(dp=128, tp=8, zero=3), MUON)
    assert len(plan.owner_flops) == 1024
    assert max(plan.owner_flops) - min(plan.owner_flops) <= plan.largest_flops
    gathered = sum(s[0] for s in plan.sent)
    assert gathered == sum(r[0] for r in plan.received)  # every element sent is received


def test_the_search_prices_its_first_layouts_from_the_plan():
    from paratrain.planner.hardware import hardware
    from paratrain.planner.search import EXACT, estimate, search

    hw = hardware("a100-80gb")
    result = search(PRESETS["gpt2"], 8, hw, global_batch=64, settings=MUON)
    kinds = [r["muon_exchange"] for r in result["candidates"] if r["fits"]]
    assert len(kinds) > EXACT and kinds[:EXACT] == ["exact"] * EXACT and set(kinds[EXACT:]) == {"estimated"}
    best = result["candidates"][0]
    again = estimate(PRESETS["gpt2"], Layout.of(**best["layout"]), hw, global_batch=64, settings=MUON)
    assert again["memory"] == best["memory"] and again["step_time_s"] == best["step_time_s"]
