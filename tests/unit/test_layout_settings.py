"""The settings of a layout declared once (paratrain.config.layout): every planner field has its place in the
run, and `--plan auto` hands over the whole chosen layout, field by field, through the run file the workers read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from paratrain.cli.flags import ARGUMENT_PATHS
from paratrain.config import RunConfig, check_run, preset, read_run, write_run
from paratrain.config.layout import LAYOUT_SETTINGS, apply_layout, layout_of
from paratrain.planner.auto import choose_layout
from paratrain.planner.hardware import hardware
from paratrain.planner.layout import LAYOUT_FIELDS, Layout
from paratrain.planner.search import candidates


def test_every_planner_field_is_declared_once_with_a_flag():
    names = [setting.name for setting in LAYOUT_SETTINGS]
    assert sorted(names) == sorted(LAYOUT_FIELDS) and len(set(names)) == len(names)
    flags = set(ARGUMENT_PATHS.values())
    for setting in LAYOUT_SETTINGS:
        section, attribute = setting.path.split(".")
        assert hasattr(getattr(RunConfig(), section), attribute), setting.path
        assert setting.path in flags, f"{setting.path}: no `paratrain train` flag sets it"


def _handed_over(config: RunConfig, tmp_path: Path) -> RunConfig:
    """What a worker reads: the run file the launcher writes."""
    return read_run(write_run(config, tmp_path / "run.json"))


@pytest.mark.parametrize("model,devices,dpn", [("gpt3-13b", 64, 1), ("gpt3-xl", 16, 8), ("tiny-moe", 8, 8)])
def test_every_layout_the_search_can_vary_reaches_the_run_field_by_field(tmp_path, model, devices, dpn):
    """Every candidate of the search (grids, cp and its modes, ep, expert tp, pp and chunks, ZeRO, micro-batch,
    recompute, sequence parallelism), set on a run and read back from the workers' run file, is itself."""
    hw = dataclasses.replace(hardware("a100-80gb"), devices_per_node=dpn)
    config = preset(model) if model != "tiny-moe" else preset("tiny", n_experts=4, top_k=2)
    layouts = candidates(config, devices, hw, global_batch=64, seq=config.seq_len)
    varied = {name for name in LAYOUT_FIELDS if len({str(layout.to_dict()[name]) for layout in layouts}) > 1}
    assert len(layouts) > 50 and len(varied) >= 8, varied
    for layout in layouts[::7]:
        fields = layout.to_dict()
        run = _handed_over(apply_layout(RunConfig(), fields), tmp_path)
        assert Layout.of(**layout_of(run)).to_dict() == fields


def test_plan_auto_runs_the_grid_with_shard_groups_it_printed(tmp_path):
    """One GPU per node: the search ranks a 3D grid best for a 13B model on 32 GPUs with ZeRO-1 in shard groups of
    2; the run the workers read is that layout (before, the hand-over dropped tp_mode and shard_group and the run
    would have been 1d tensor parallelism across nodes under plain ZeRO)."""
    hw = dataclasses.replace(hardware("a100-80gb"), devices_per_node=1)
    config = RunConfig()
    config.model.preset, config.data.global_batch, config.data.seq_len = "gpt3-13b", 64, 2048
    chosen, text = choose_layout(config, world_size=32, hw=hw, pins={"pp": 1, "zero": 1, "shard_group": 2},
                                 seq_len=2048)
    run = _handed_over(chosen, tmp_path)
    assert (run.parallel.tp_mode, run.parallel.shard_group, run.parallel.tp) == ("3d", 2, 8)
    assert "3d" in text and "shard groups of 2" in text
    plan = check_run(run, 32)  # what each worker builds
    assert (plan.parallel.tp_mode, plan.parallel.shard_group, plan.parallel.dp) == ("3d", 2, 4)


def test_activation_offload_is_kept_when_the_planner_sets_the_optimizer_s():
    config = RunConfig(parallel=dataclasses.replace(RunConfig().parallel, offload="activations"))
    assert apply_layout(config, {"offload": True}).parallel.offload == "optimizer,activations"
    assert apply_layout(config, {"offload": False}).parallel.offload == "activations"
    assert layout_of(apply_layout(RunConfig(), {"offload": True}))["offload"] is True
    with pytest.raises(ValueError, match="no LayoutSetting"):
        apply_layout(config, {"warp_drive": 2})
