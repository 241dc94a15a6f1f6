"""paratrain's Engine against a plain PyTorch loop on one GPU: step time, MFU and memory.

    python -m bench.bench_gpu                           # gpt2 and gpt3-xl, every variant (~8 min on an H100)
    python -m bench.bench_gpu --models gpt2 --steps 10 --json out.json
    python -m bench.bench_gpu --only 4,5 --repeat 2     # compiled plain vs engine, twice in turn

Both contenders train the same GPT (bf16 autocast over float32 weights, fused AdamW, clip 1.0, one
process) on the same batches with the same micro-batching and the same loss (the chunked
cross-entropy of paratrain.nn.loss), so the ratio engine / plain is what the engine adds: its
gradient buckets, its global-batch token normalisation, its norm and clip, its non-finite watch.
Each configuration runs `--warmup` steps (compilation happens there), then `--steps` timed steps
with nothing read back, closed by one synchronisation; the plain loop likewise.

Rows, per model:
  plain / engine, eager / compiled     engine overhead (target: <= 1.02)
  engine recompute full / selective    time against the same mode without (target full: <= 1.4x)
  engine offload activations           memory drop and time cost
  plain with F.cross_entropy           what the chunked loss saves (its float32 logits and gradient)
  engine Muon                          Muon on the matrices (bf16 Newton-Schulz), AdamW on the rest, vs AdamW
  engine fp8 tensorwise / rowwise      the blocks' linears in float8 (paratrain.memory.float8), vs bf16
and, for the engine rows, the planner's predicted peak memory and step time beside the measured
(paratrain.planner.estimate with the card's profile: h200 or h100-80gb), and the host synchronisations of a step that
does not log (torch.cuda.set_sync_debug_mode).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any, Callable


import torch
import torch.nn.functional as F

import paratrain
from paratrain.config import preset
from paratrain.models import lm_loss
from paratrain.train.metrics import peak_flops

SPECS = {"gpt2": (32, 16), "gpt3-xl": (16, 8), "gpt3-2.7b": (8, 4)}
"""Model preset -> (global batch, micro-batch) at the preset's sequence length."""


def _batches(vocab: int, batch: int, seq: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=generator).cuda()
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _full_logits_loss(model: torch.nn.Module, micro: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """What a plain loop usually writes: the whole logits in float32, then F.cross_entropy."""
    inputs, targets = micro
    logits = model(inputs)[..., : model.config.vocab_size]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum"), targets.numel()


def _plain(config: Any, micro: int, *, compile: bool, loss: Callable = lm_loss) -> tuple[Callable, torch.nn.Module]:
    model = paratrain.build_gpt(config, seed=0, device="cuda")
    if compile:
        for block in model.blocks:
            block.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        tokens = targets.numel()
        for i in range(0, inputs.shape[0], micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                total, _ = loss(model, (inputs[i: i + micro], targets[i: i + micro]))
            (total / tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def _engine(config: Any, micro: int, *, compile: bool, recompute: str = "none", offload: str = "none",
            optimizer: str = "adamw", precision: str = "bf16", fp8_recipe: str = "tensorwise") -> tuple[Callable, Any]:
    from paratrain.optim import MuonFactory, MuonSettings

    ctx = paratrain.init(paratrain.ParallelConfig(offload=offload), device="cuda")
    model = paratrain.build_gpt(config, seed=0)
    factory = (MuonFactory(MuonSettings(lr=1e-4)) if optimizer == "muon"
               else lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    engine = paratrain.parallelize(model, ctx, optimizer=factory,
                                   options=paratrain.EngineOptions(
                                       micro_batch=micro, precision=precision, grad_clip=1.0, recompute=recompute,
                                       compile=compile, fp8=paratrain.Float8Settings(recipe=fp8_recipe)))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        engine.step(batch, lm_loss)

    return step, engine


def _time(step: Callable, batches: list, *, warmup: int, steps: int) -> float:
    for i in range(warmup):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _host_syncs(step: Callable, batch: Any) -> int | str:
    """Synchronisations in one step that reads nothing (0, or the error sync debug mode raised)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(batch)
        return 0
    except RuntimeError as error:
        return str(error).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def planner_prediction(config: Any, batch: int, micro: int, variant: dict[str, Any],
                       profile: str) -> dict[str, float]:
    """The planner's peak memory and step time for an engine row (`profile`: the card's hardware profile)."""
    from paratrain.planner import estimate
    from paratrain.planner.hardware import hardware
    from paratrain.planner.layout import Layout
    from paratrain.planner.settings import StepSettings

    record = estimate(config, Layout(micro_batch=micro, recompute=variant.get("recompute", "none")), hardware(profile),
                      global_batch=batch, kernels="compiled" if variant["compile"] else "eager",
                      settings=StepSettings(precision=variant.get("precision", "bf16"),
                                            fp8_recipe=variant.get("fp8_recipe", "tensorwise"),
                                            optimizer=variant.get("optimizer", "adamw")))
    return {"predicted_peak_gb": record["memory"]["peak"] / 1e9, "predicted_step_s": record["step_time_s"]}


def _measure(name: str, variant: dict[str, Any], config: Any, batch: int, micro: int, args: argparse.Namespace,
             peak: float | None) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    batches = _batches(config.vocab_size, batch, config.seq_len)
    kind = variant["kind"]
    if kind == "plain":
        step, holder = _plain(config, micro, compile=variant["compile"],
                              loss=_full_logits_loss if variant.get("loss") == "full" else lm_loss)
    else:
        step, holder = _engine(config, micro, compile=variant["compile"], recompute=variant.get("recompute", "none"),
                               offload=variant.get("offload", "none"), optimizer=variant.get("optimizer", "adamw"),
                               precision=variant.get("precision", "bf16"),
                               fp8_recipe=variant.get("fp8_recipe", "tensorwise"))
    seconds = _time(step, batches, warmup=args.warmup, steps=args.steps)
    row = {"model": name, **variant, "global_batch": batch, "micro_batch": micro, "step_s": seconds,
           "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    tokens_per_s = batch * config.seq_len / seconds
    if peak:
        row["mfu"] = tokens_per_s * config.flops_per_token(config.seq_len) / peak
    if kind == "engine":
        row["host_syncs_quiet_step"] = _host_syncs(step, batches[0])
        row["memory_report_gb"] = {k: v / 1e9 for k, v in holder.memory_report().items()}
        if variant.get("offload", "none") == "none":
            profile = "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-80gb"
            row.update(planner_prediction(config, batch, micro, variant, profile))
    del step, holder
    return row


def _variants(compiled: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    modes = [False, True] if compiled else [False]
    for compile in modes:
        rows += [dict(kind="plain", compile=compile), dict(kind="engine", compile=compile)]
        rows += [dict(kind="engine", compile=compile, recompute=r) for r in ("full", "selective")]
    rows.append(dict(kind="engine", compile=False, offload="activations"))
    rows.append(dict(kind="plain", compile=False, loss="full"))
    rows.append(dict(kind="engine", compile=compiled, optimizer="muon"))  # Muon (bf16 Newton-Schulz), AdamW on the rest
    rows += [dict(kind="engine", compile=compiled, precision="fp8", fp8_recipe=r) for r in ("tensorwise", "rowwise")]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,gpt3-xl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--only", default="", help="comma-separated variant indices to run")
    parser.add_argument("--repeat", type=int, default=1, help="run the variants this many times in turn; the "
                        "table takes each one's median")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    device = torch.device("cuda", 0)
    peak = peak_flops(device)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, peak bf16 {peak and peak / 1e12:.0f} TFLOP/s")
    rows = []
    variants = _variants(args.compile)
    only = {int(i) for i in args.only.split(",") if i}
    for name in args.models.split(","):
        batch, micro = SPECS[name]
        config = preset(name)
        for index, variant in [(i, v) for _ in range(args.repeat) for i, v in enumerate(variants)]:
            if only and index not in only:
                continue
            try:
                row = _measure(name, variant, config, batch, micro, args, peak)
            except torch.cuda.OutOfMemoryError as error:
                row = {"model": name, **variant, "error": f"out of memory: {str(error)[:120]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    _report(rows)


def _report(rows: list[dict[str, Any]]) -> None:
    """Markdown: the ratios the docs quote."""
    def find(model: str, **want: Any) -> dict[str, Any] | None:
        """The matching row of median step time (one per --repeat)."""
        found = sorted((row for row in rows if row["model"] == model and "error" not in row
                        and all(row.get(k, d) == v for k, (v, d) in want.items())), key=lambda row: row["step_s"])
        return found[(len(found) - 1) // 2] if found else None

    print("\n| model | mode | plain MFU | engine MFU | engine / plain | full recompute / none | selective / none "
          "| engine peak GB | planner peak GB | engine step s | planner step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in dict.fromkeys(r["model"] for r in rows):
        for compile in (False, True):
            base = dict(compile=(compile, False), recompute=("none", "none"), offload=("none", "none"),
                        loss=("chunked", "chunked"), optimizer=("adamw", "adamw"))
            plain = find(model, kind=("plain", None), **base)
            engine = find(model, kind=("engine", None), **base)
            full = find(model, kind=("engine", None), **{**base, "recompute": ("full", "none")})
            selective = find(model, kind=("engine", None), **{**base, "recompute": ("selective", "none")})
            if not (plain and engine):
                continue
            muon = find(model, kind=("engine", None), **{**base, "optimizer": ("muon", "adamw")})
            if muon:
                print(f"<!-- {model} {'compiled' if compile else 'eager'}: engine Muon / AdamW step time "
                      f"{muon['step_s'] / engine['step_s']:.3f} -->")
            ratio = lambda r: f"{r['step_s'] / engine['step_s']:.3f}" if r else "-"  # noqa: E731
            print(f"| {model} | {'compiled' if compile else 'eager'} | {plain.get('mfu', 0):.1%} | "
                  f"{engine.get('mfu', 0):.1%} | {engine['step_s'] / plain['step_s']:.3f} | {ratio(full)} | "
                  f"{ratio(selective)} | {engine['max_allocated_gb']:.1f} | {engine.get('predicted_peak_gb', 0):.1f} | "
                  f"{engine['step_s']:.3f} | {engine.get('predicted_step_s', 0):.3f} |")


if __name__ == "__main__":
    main()
