"""Float8 against bf16 over a training run: the loss curves of precision fp8 (tensorwise, rowwise) and bf16, and
their step times, one process.

    python -m bench.bench_fp8                       # the small GPT, 200 steps, on this CPU (about 2 minutes on 2 cores)
    python -m bench.bench_fp8 --device cuda --model gpt3-xl --steps 200 --compile --json out.json   # on a GPU

Each precision trains the same GPT from the same weights on the same batches (the builtin text, warmup then cosine,
AdamW, clip 1.0). Reported: the mean loss of the last 10 steps, its relative distance from bf16's, and the median
step time. On a CPU torch emulates float8 matmuls, so fp8's step time there says nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import paratrain
from paratrain.config import preset
from paratrain.data import GlobalBatchLoader, load_source
from paratrain.memory import Float8Settings
from paratrain.train.schedule import lr_at

RUNS = {"bf16": ("bf16", "tensorwise"), "fp8-tensorwise": ("fp8", "tensorwise"), "fp8-rowwise": ("fp8", "rowwise")}


def train(run: str, args: argparse.Namespace) -> dict:
    precision, recipe = RUNS[run]
    config = preset(args.model)
    ctx = paratrain.init(device=args.device)
    model = paratrain.build_gpt(config, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.1),
                                   options=paratrain.EngineOptions(micro_batch=args.micro_batch, precision=precision,
                                                                   grad_clip=1.0, compile=args.compile,
                                                                   fp8=Float8Settings(recipe=recipe)))
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=config.seq_len, global_batch=args.global_batch,
                               dp=1, dp_index=0, seed=0)
    losses, seconds = [], []
    for step in range(args.steps):
        engine.set_lr(lr_at(step, total_steps=args.steps, peak=args.lr, warmup_steps=args.steps // 10, min_ratio=0.1))
        batch = loader.next()
        start = time.perf_counter()
        losses.append(engine.train_step(batch, paratrain.lm_loss))
        seconds.append(time.perf_counter() - start)
    ctx.close()
    return {"losses": losses, "final": statistics.fmean(losses[-10:]), "step_s": statistics.median(seconds[3:])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    rows = {run: train(run, args) for run in args.runs.split(",")}
    base = rows.get("bf16")
    for run, row in rows.items():
        apart = abs(row["final"] - base["final"]) / base["final"] if base else float("nan")
        row["from_bf16"] = apart
        print(f"{run:15s} last-10 loss {row['final']:.4f}  ({apart:.2%} from bf16)  step {row['step_s'] * 1e3:.1f} ms")
    if args.json:
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (2 cores)"
        Path(args.json).write_text(json.dumps({"device": device, "args": vars(args), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
