"""Every benchmark's smallest case runs (one timed step, the smallest world, paratrain's own contender: torch's do
not change with paratrain), so that a change to paratrain cannot leave a benchmark broken unnoticed. It checks that they run, not their numbers
(docs/benchmarks.md has those, measured by the full commands)."""

from __future__ import annotations

import importlib

import pytest
import torch

SMALLEST = {
    "bench_dp": ["--worlds", "2", "--steps", "1", "--rounds", "1"],
    "bench_zero": ["--worlds", "2", "--steps", "1", "--only", "paratrain-zero3"],
    "bench_tp": ["--steps", "1", "--only", "paratrain-tp2"],
    "bench_cp": ["--steps", "1", "--seq", "64", "--cp", "2", "--modes", "ring"],
    "bench_cp_balance": ["--cp", "2", "--windows", "even"],
    "bench_pp": ["--steps", "1", "--only", "paratrain-1f1b"],
    "bench_bubble": ["--pp", "2", "--schedules", "1f1b", "--steps", "1", "--unit", "2"],
    "bench_moe": ["--steps", "3", "--only", "paratrain-ep2"],  # step 0 warms up, step 1 counts bytes: one timed step
    "bench_checkpoint": ["--models", "tiny", "--world", "2", "--modes", "sharded", "sharded-async"],
    "bench_materialize": ["--model", "tiny", "--world", "2", "--whole-world", "2", "--modes", "meta"],
    "bench_ps": ["--world", "2", "--steps", "1", "--only", "ps-dedicated", "--scenarios", "alternating",
                 "--stalenesses", "--straggler-steps", "2"],  # part 2 synchronous only (async: the ps tests)
    "bench_planner": ["--steps", "1", "--hardware", "a100-80gb", "--layouts", "6"],
    "bench_optim": ["--worlds", "2", "--steps", "1", "--only", "paratrain-muon-zero1"],
    "bench_fp8": ["--model", "tiny", "--steps", "4", "--runs", "bf16,fp8-tensorwise"],
    "bench_gpu": ["--models", "tiny", "--steps", "1", "--warmup", "1", "--no-compile", "--only", "0"],
}


def test_the_gpu_benchmarks_planner_column_runs_without_a_gpu():
    """bench_gpu runs only where a GPU is lent; its planner column, which follows the planner's signatures, is
    checked here (it once broke unnoticed until a GPU session)."""
    from bench.bench_gpu import _variants, planner_prediction
    from paratrain.config import preset

    for variant in _variants(True):
        if variant["kind"] == "engine" and "offload" not in variant:
            row = planner_prediction(preset("gpt3-xl"), 16, 8, variant, "h200")
            assert row["predicted_peak_gb"] > 10 and row["predicted_step_s"] > 0.1


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.gpu) if name == "bench_gpu" else name
                                  for name in SMALLEST])
def test_benchmark_runs(name, tmp_path, capsys):
    if name == "bench_gpu" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    module = importlib.import_module(f"bench.{name}")
    module.main([*SMALLEST[name], "--json", str(tmp_path / "out.json")])
    assert (tmp_path / "out.json").stat().st_size > 2, capsys.readouterr().out[-2000:]
