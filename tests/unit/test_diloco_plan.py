"""`paratrain plan --dp-mode diloco`: one replica group's layouts, each with DiLoCo's outer step added (the outer
elements' count is checked against the engine in tests/distributed/test_diloco.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.cli import main
from paratrain.config import preset
from paratrain.planner.dp_comm import outer_elements
from paratrain.planner.hardware import hardware
from paratrain.planner.layout import Layout
from paratrain.planner.search import PRICED, search


def _plan(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--global-batch", "16", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_group_is_priced_as_its_own_job_plus_the_outer_step(capsys):
    got = _plan(capsys, "--dp-mode", "diloco", "--replica-groups", "2", "--inner-steps", "4")
    alone = search(preset("tiny"), 2, hardware("h100-80gb"), global_batch=8, settings=dataclasses.replace(PRICED))
    by_layout = {json.dumps(r["layout"], sort_keys=True): r for r in alone["candidates"]}
    assert got["diloco"] == {"replica_groups": 2, "inner_steps": 4} and got["candidates"]
    for record in got["candidates"]:
        layout = Layout.of(**record["layout"])
        elements = max(outer_elements(preset("tiny"), layout, stage=s, settings=PRICED) for s in range(layout.pp))
        assert record["diloco"]["outer_elements"] == elements
        assert record["memory"]["diloco"] == 2 * 4 * elements  # outer copy + Nesterov buffer, float32
        group = by_layout[json.dumps(record["layout"], sort_keys=True)]
        assert record["memory"]["peak"] == group["memory"]["peak"] + 2 * 4 * elements
        outer = record["terms"]["diloco outer step (per step)"]
        assert outer > 0 and record["step_time_s"] == pytest.approx(group["step_time_s"] + outer)
        assert record["tokens_per_s"] == pytest.approx(2 * group["tokens_per_s"] * group["step_time_s"]
                                                       / record["step_time_s"])


@pytest.mark.parametrize("flags, message", [
    (("--dp-mode", "diloco", "--replica-groups", "3"), "must be >= 2 and divide --gpus"),
    (("--dp-mode", "diloco", "--replica-groups", "2", "--inner-steps", "0"), "--inner-steps must be >= 1"),
    (("--replica-groups", "2",), "give --dp-mode diloco"),
])
def test_bad_groups_are_refused(capsys, flags, message):
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--global-batch", "16", *flags]) == 2
    assert message in capsys.readouterr().err
