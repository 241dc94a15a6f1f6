"""Where each tensor-parallel mode beats 1D, by the planner (no run: paratrain.planner's step-time model on a named
GPU profile, whose tp term lists every collective each mode issues, checked to the byte by dry runs).

    python -m bench.plan_tp_modes                    # the table in docs/planner.md
    python -m bench.plan_tp_modes --hardware a100-80gb --gpus-per-node 4

One layout per row, everything but the tp mode fixed: dp 1, pp 1, ZeRO-1, full recompute, micro-batch 16 of the
model's sequence (a global batch of one micro-batch), bf16; the tp group the given size, on nodes of the given GPUs
(a tp group larger than a node crosses the inter-node links: 1d's all-reduces, and the grid sub-axes that span
nodes). Reported: the predicted step time, its tp collectives, and the per-rank peak memory; '-' where the mode's
rules refuse the shape (heads, widths or vocabulary not divisible, tp not a square / cube).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paratrain.config import ConfigError, preset
from paratrain.planner.hardware import hardware
from paratrain.planner.layout import Layout
from paratrain.planner.search import estimate, grid_modes

MODELS = ("gpt3-xl", "gpt3-13b", "gpt3-175b")
TPS = (4, 8, 16, 64)
MICRO_BATCH = 16


def rows(profile: str, per_node: int) -> list[dict]:
    from dataclasses import replace

    hw = replace(hardware(profile), devices_per_node=per_node)
    out = []
    for name in MODELS:
        model = preset(name)
        for tp in TPS:
            row: dict = {"model": name, "d_model": model.d_model, "tp": tp, "per_node": per_node}
            for mode, depth in [("1d", 1), *grid_modes(tp)]:
                key = mode if mode != "2.5d" else f"2.5d-d{depth}"
                layout = Layout.of(tp=tp, tp_mode=mode, tp_depth=depth, zero=1, micro_batch=MICRO_BATCH,
                                   recompute="full")
                try:
                    record = estimate(model, layout, hw, global_batch=MICRO_BATCH)
                except ConfigError:
                    row[key] = None
                    continue
                row[key] = {"step_s": record["step_time_s"], "tp_s": record["terms"]["tp collectives"],
                            "peak_gb": record["memory"]["peak"] / 1e9}
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    table = rows(args.hardware, args.gpus_per_node)
    modes = sorted({k for r in table for k in r if k not in ("model", "d_model", "tp", "per_node")},
                   key=lambda k: (("1d", "2d", "2.5d", "3d").index(k.split("-")[0]), k))
    print(f"{args.hardware}, {args.gpus_per_node} GPUs a node; step s (tp collectives s) per mode, micro-batch "
          f"{MICRO_BATCH}, full recompute, ZeRO-1, bf16")
    print(f"| model (d_model) | tp | {' | '.join(modes)} | fastest |")
    print("|---|---|" + "---|" * (len(modes) + 1))
    for r in table:
        cells, best = [], None
        for m in modes:
            v = r.get(m)
            cells.append("-" if not v else f"{v['step_s']:.3f} ({v['tp_s']:.3f})")
            if v and (best is None or v["step_s"] < r[best]["step_s"]):
                best = m
        print(f"| {r['model']} ({r['d_model']}) | {r['tp']} | {' | '.join(cells)} | {best} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
