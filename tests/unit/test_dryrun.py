"""Dry runs: one rank of layouts up to 1,024 ranks, built and stepped on the meta device with a fake
process group, holds exactly the model-state bytes the planner predicts and moves exactly the
data-parallel gradient and parameter bytes it predicts."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.config import ParallelConfig, preset
from paratrain.planner.dryrun import dry_run

GRID = [  # (model, world, rank, layout, global batch, micro-batch, precision)
    ("tiny", 8, 5, dict(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True, schedule="interleaved", virtual_stages=2),
     8, 2, "fp32"),
    ("tiny", 4, 3, dict(dp=4, zero=3, grad_reduce="reduce_scatter"), 16, 2, "bf16"),
    ("gpt3-175b", 1024, 1000, dict(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True, grad_reduce="reduce_scatter"),
     16, 1, "bf16"),
    ("gpt3-175b", 1024, 3, dict(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True), 16, 1, "bf16"),
    ("gpt3-6.7b", 1024, 777, dict(dp=128, tp=8, zero=3, grad_reduce="reduce_scatter"), 128, 1, "bf16"),
    ("gpt3-13b", 512, 300, dict(dp=8, tp=8, pp=8, zero=2), 16, 1, "fp32"),
]


@pytest.mark.parametrize("model,world,rank,layout,global_batch,micro_batch,precision", GRID,
                         ids=[f"{g[0]}-{g[1]}ranks-rank{g[2]}" for g in GRID])
def test_a_dry_run_equals_the_planner_exactly(model, world, rank, layout, global_batch, micro_batch, precision):
    run = dry_run(preset(model), ParallelConfig(**layout), rank=rank, world_size=world, global_batch=global_batch,
                  micro_batch=micro_batch, precision=precision)
    assert run.memory == run.predicted_memory
    assert run.data_parallel_volume == run.predicted_volume
    assert sum(run.data_parallel_volume.values()) > 0 and run.collectives
    assert bool(run.actions) == (layout.get("pp", 1) > 1)
    assert {c.axis for c in run.collectives} >= {"dp"} | ({"tp"} if layout.get("tp", 1) > 1 else set())


def test_the_command_reports_a_rank_of_1024(capsys):
    code = main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--dp", "16", "--tp", "8", "--pp", "8", "--zero", "1",
                 "--sequence-parallel", "--global-batch", "16", "--dry-run", "--rank", "1023", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["exact"] and record["coords"] == {"dp": 15, "tp": 7, "pp": 7}
    assert record["actions"][:2] == ["RECV_F chunk 7 mb 0", "F chunk 7 mb 0"]
    with pytest.raises(ValueError, match="--rank must be in"):
        dry_run(preset("tiny"), ParallelConfig(dp=2), rank=2, world_size=2, global_batch=2)
