"""paratrain scaling and paratrain plot: the experiment's rules, a real 1- and 2-process run of the
fixed-global-batch mode (the same curve and accuracy), and the pictures."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.plot import plot_runs, plot_scaling
from paratrain.scaling import Recipe, experiment, settings
from tests.helpers import rel_diff
from tests.margins import within


def test_the_three_modes_scale_batch_and_rate_as_documented():
    recipe = Recipe(batch=32, lr=0.05, epochs=10, warmup_epochs=2)
    assert settings("fixed-device-batch", 4, recipe, 1437) == {"global_batch": 128, "lr": 0.05, "warmup_steps": 0,
                                                                "steps": 110}
    assert settings("fixed-global-batch", 4, recipe, 1437) == {"global_batch": 32, "lr": 0.05, "warmup_steps": 0,
                                                                "steps": 440}
    assert settings("scaled-lr", 4, recipe, 1437) == {"global_batch": 128, "lr": 0.2, "warmup_steps": 22, "steps": 110}
    with pytest.raises(ConfigError, match="split evenly"):
        settings("fixed-global-batch", 3, recipe, 1437)
    with pytest.raises(ConfigError, match="not one of"):
        settings("linear", 2, recipe, 1437)


@pytest.mark.e2e
def test_fixed_global_batch_gives_the_one_process_curve_on_two():
    one, two = experiment([1, 2], ["fixed-global-batch"], Recipe(epochs=1), single_here=True)
    assert (one["procs"], two["procs"], one["global_batch"], two["global_batch"]) == (1, 2, 32, 32)
    within(rel_diff(two["losses"], one["losses"]), 1e-12, "digits loss curve, 2 processes vs 1 (float64)")
    assert two["accuracy"] == one["accuracy"]


def test_plots_are_written(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.5)):
        lines = [{"step": 0, "val_loss": 3.0 * scale}] + [{"step": s, "loss": scale * 3 / s} for s in range(1, 6)]
        lines.append({"step": 5, "loss": scale * 0.6, "val_loss": scale * 0.7})
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "c.png"),
                 "--labels", "first,second"]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    runs = [{"mode": m, "procs": p, "wall_s": 1.0 * p, "accuracy": 0.9} for m in ("x", "y") for p in (1, 2, 4)]
    assert plot_scaling(runs, tmp_path / "s.png").stat().st_size > 1000
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 1
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no record holds a loss"):
        plot_runs([tmp_path / "bad.jsonl"], tmp_path / "d.png")
