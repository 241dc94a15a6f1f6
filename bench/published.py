"""The planner against published Megatron runs, and against Calculon on the same runs.

    python -m bench.published                                   # paratrain's predictions vs Table 5
    python -m bench.published --calculon DIR --calculon-python PY --out bench/results/published-megatron.json

Korthikanti et al. 2022, Table 5 (paratrain.planner.published): seconds per step and memory per GPU of
Megatron-LM's 22B, 175B, 530B and 1T GPT models on 80 GB A100s; Narayanan et al. 2021, Table 1 (1.7B-1T,
weak scaling, its micro-batch not published: predicted with 1, 2 and 4) and Table 2 (PTD-P against ZeRO-3). paratrain predicts each with the shipped
a100-80gb profile (its rates fitted to these rows: paratrain.planner.fit --published) and Megatron's fused
kernels. With --calculon, Calculon (Isaev et al., SC'23; a checkout of github.com/calculon-ai/calculon, whose
Python needs pandas and psutil) runs its own validation of the same table (`calculon lv`), and its step
times and memory are set beside paratrain's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from paratrain.planner.hardware import GIB, hardware
from paratrain.planner.published import (NARAYANAN, NARAYANAN_TABLE2, korthikanti_table5, narayanan_table1,
                                         narayanan_table2)
from paratrain.planner.search import PRICED, memory
from paratrain.planner.timing import step_time

CALCULON_NAMES = {"megatron-22B": "22B", "gpt3-175B": "175B", "turing-530B": "530B", "megatron-1T": "1T"}


def calculon_table5(checkout: str, python: str) -> dict[str, dict[str, float]]:
    """{"175B seqsel": {"step_s", "memory_gib"}, ...} from Calculon's `llm-validation` end-to-end section."""
    out = subprocess.run([python, "bin/calculon", "lv"], cwd=checkout, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": checkout}).stdout
    section = out.split("End-to-end")[1].splitlines()
    rows: dict[str, dict[str, float]] = {}
    for line in section:
        cells = line.split(",")
        if cells[0] in CALCULON_NAMES:  # model,|,profile,calc,delta,GiB,|,profile,calc,delta,GiB
            name = CALCULON_NAMES[cells[0]]
            rows[f"{name} full"] = {"step_s": float(cells[3]), "memory_gib": float(cells[5])}
            rows[f"{name} seqsel"] = {"step_s": float(cells[8]), "memory_gib": float(cells[10])}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calculon", help="a Calculon checkout to run its Table 5 validation")
    parser.add_argument("--calculon-python", default="python3", help="a Python with pandas and psutil for Calculon")
    parser.add_argument("--out", help="write the rows here (JSON)")
    args = parser.parse_args()
    calc = calculon_table5(args.calculon, args.calculon_python) if args.calculon else {}
    a100 = hardware("a100-80gb")
    rows = []
    print(f"{'run':<12} {'published s':>11} {'paratrain s':>11} {'ratio':>6} {'calculon s':>10} {'ratio':>6} "
          f"{'MFU pub':>7} {'MFU pred':>8} {'peak GiB':>8} {'calc GiB':>8}")
    for run in korthikanti_table5():
        t = step_time(run.model, run.layout, a100, global_batch=run.global_batch, seq=2048,
                      settings=replace(PRICED, precision=run.precision), kernels="fused")
        mem = memory(run.model, run.layout, global_batch=run.global_batch, seq=2048,
                     settings=replace(PRICED, precision=run.precision))
        flops = run.model.flops_per_token(2048) * run.global_batch * 2048
        row = {"run": run.name, "published_s": run.step_s, "predicted_s": t.step_s,
               "published_mfu": flops / (run.step_s * run.layout.world_size * a100.peak_flops), "predicted_mfu": t.mfu,
               "peak_gib": mem["peak"] / GIB, "terms": t.terms, **{f"calculon_{k}": v for k, v in calc.get(run.name, {}).items()}}
        rows.append(row)
        c = calc.get(run.name, {})
        print(f"{run.name:<12} {run.step_s:>11.2f} {t.step_s:>11.2f} {t.step_s / run.step_s:>6.3f} "
              f"{c.get('step_s', float('nan')):>10.2f} {c.get('step_s', float('nan')) / run.step_s:>6.3f} "
              f"{row['published_mfu']:>7.1%} {t.mfu:>8.1%} {row['peak_gib']:>8.1f} {c.get('memory_gib', float('nan')):>8.1f}")
    print(f"\nNarayanan et al. 2021, Table 1 (micro-batch not published: predicted with 1, 2 and 4)\n"
          f"{'run':<8} {'published s':>11} {'mb 1 s':>8} {'ratio':>6} {'mb 2 s':>8} {'ratio':>6} {'mb 4 s':>8} "
          f"{'ratio':>6} {'TFLOP/s pub':>11} {'pred (mb 1)':>11} {'peak GiB':>8}")
    weak = []
    for runs in zip(*(narayanan_table1(mb) for mb in (1, 2, 4))):
        one = runs[0]
        times = [predicted(r, a100) for r in runs]
        peak = memory(one.model, one.layout, global_batch=one.global_batch, seq=2048,
                      settings=replace(PRICED, precision=one.precision))["peak"]
        tflops = NARAYANAN[one.name][7]
        weak.append({"run": one.name, "published_s": one.step_s, **{f"predicted_s_mb{mb}": t for mb, t in
                                                                    zip((1, 2, 4), times)},
                     "published_tflops": tflops, "peak_gib_mb1": peak / GIB})
        print(f"{one.name:<8} {one.step_s:>11.2f} " + " ".join(f"{t:>8.2f} {t / one.step_s:>6.3f}" for t in times)
              + f" {tflops:>11} {tflops * one.step_s / times[0]:>11.1f} {peak / GIB:>8.1f}")
    print(f"\nNarayanan et al. 2021, Table 2 (PTD-P against ZeRO-3 without model parallelism)\n"
          f"{'run':<20} {'published s':>11} {'paratrain s':>11} {'ratio':>6} {'TFLOP/s pub':>11} {'pred':>6} "
          f"{'peak GiB':>8}")
    table2 = []
    for run, (*_, tflops, days) in zip(narayanan_table2(), NARAYANAN_TABLE2):
        t = step_time(run.model, run.layout, a100, global_batch=run.global_batch, seq=2048,
                      settings=replace(PRICED, precision=run.precision), kernels="fused")
        peak = memory(run.model, run.layout, global_batch=run.global_batch, seq=2048,
                      settings=replace(PRICED, precision=run.precision))["peak"]
        table2.append({"run": run.name, "published_s": run.step_s, "predicted_s": t.step_s, "published_tflops": tflops,
                       "published_days": days, "peak_gib": peak / GIB, "terms": t.terms})
        print(f"{run.name:<20} {run.step_s:>11.2f} {t.step_s:>11.2f} {t.step_s / run.step_s:>6.3f} {tflops:>11} "
              f"{tflops * run.step_s / t.step_s:>6.1f} {peak / GIB:>8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"korthikanti_table5": rows, "narayanan_table1": weak,
                                              "narayanan_table2": table2}, indent=1) + "\n")


def predicted(run, hw) -> float:
    return step_time(run.model, run.layout, hw, global_batch=run.global_batch, seq=2048,
                     settings=replace(PRICED, precision=run.precision), kernels="fused").step_s


if __name__ == "__main__":
    main()
