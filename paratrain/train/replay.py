"""`paratrain replay CKPT --step S`: recompute one step of a run on one process, and look inside it.

    paratrain replay runs/a/ckpt --step 7 --log runs/a/log.jsonl
    paratrain replay runs/a/ckpt --step 7 --json

A run's step S is a function of the state after step S - 1 and of the samples global batch S holds, and both are
layout-free in paratrain: the checkpoint is a whole-model view any layout loads, and the global batch is the
loader's keyed order at the cursor the checkpoint keeps (never a per-rank file offset). So the newest checkpoint
at or before step S - 1, resumed in one process (the run's config with every parallel setting at its default), and
trained on to step S, recomputes step S of any layout the run had: the same loss and gradient norm up to float
rounding, and the same samples (tests/e2e/test_cli.py::test_replay_recomputes_a_step_of_a_4_process_run_in_one).

At step S the replay also reports what the run's log cannot: each tensor's gradient norm (the mean gradient over
the global batch's tokens, before clipping: what the logged norm sums) and update norm (its change by the step),
and the samples of the global batch with the largest losses (their global sample index, loss, and text where the
data's tokenizer is known). The logged loss and gradient norm are read from the run's --log-json (`--log`, or the
path the checkpoint's config names) and printed beside the recomputed ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from paratrain.config import ConfigError, RunConfig
from paratrain.train.loop import Hook, TrainLoop


def replay_checkpoint(root: str, step: int) -> Path:
    """The newest checkpoint of `root` (a step_* folder, or the folder holding them) taken before step `step`:
    its state is that after its own step number, which must be at most step - 1."""
    path = Path(root)
    if step < 1:
        raise ConfigError(f"--step {step}: steps count from 1 (step S is computed from the state after S - 1)")
    folders = [path] if (path / "meta.json").is_file() else sorted(path.glob("step_*"))
    usable = [f for f in folders if (f / "meta.json").is_file() and _step_of(f) <= step - 1]
    if not usable:
        found = [f"{f.name} (step {_step_of(f)})" for f in folders if (f / "meta.json").is_file()]
        raise ConfigError(f"no checkpoint under {root!r} holds the state before step {step} (one taken after step "
                          f"<= {step - 1}); found {found or 'none'}: give the run's --save folder, or a step closer "
                          "to its checkpoints")
    return usable[-1]


def _step_of(folder: Path) -> int:
    meta = json.loads((folder / "meta.json").read_text())
    return int(meta.get("step", folder.name.rpartition("_")[2] or 0))


def replay_config(checkpoint: Path, step: int, *, device: str = "cpu") -> RunConfig:
    """The run's config (from the checkpoint) on one process: every parallel setting at its default, resumed from
    `checkpoint`, writing nothing (its steps kept: the learning-rate schedule reads them; StepProbe stops the loop
    after `step`)."""
    from paratrain.config.load import from_dict
    from paratrain.config.run import ParallelConfig

    meta = json.loads((checkpoint / "meta.json").read_text())
    if "config" not in meta:
        raise ConfigError(f"{checkpoint} records no run config (it was written by paratrain.Trainer, which takes "
                          "its model and data as objects): replay needs a `paratrain train` checkpoint")
    config = from_dict(meta["config"])
    config.parallel = ParallelConfig()
    config.launch = dataclasses.replace(config.launch, nproc=1, nnodes=1, node_rank=0, device=device, max_restarts=0,
                                        min_nodes=0, plan="", servers=0, first_server=0, attempt=0)
    if step > config.train.steps:
        raise ConfigError(f"--step {step}: the run trained {config.train.steps} steps")
    # what writes files or watches other ranks goes; the skipped batches and an injected spike stay (they decide
    # what a step reads). The spike policy goes: its decisions read the run's recent losses, which a resume does not
    # have (the report says when the run had one)
    config.train = dataclasses.replace(config.train, resume=str(checkpoint), save="", log_json="", log_every=1,
                                       tensorboard="", logger="", profile=0, memory_snapshot=0, check_replicas=0,
                                       straggler_factor=0.0, spike_policy="off", fail_at="", progress=False,
                                       sample_tokens=0, eval_every=0, eval_batches=1)
    return config


def logged_step(log: str, step: int) -> dict[str, Any] | None:
    """The record of `step` in a --log-json file (the last one, when a relaunch wrote it twice), or None."""
    found = None
    if log and Path(log).is_file():
        for line in Path(log).read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("step") == step and "loss" in record:
                found = record
    return found


class StepReached(Exception):
    """Raised by StepProbe once the replayed step is done: the loop stops there."""


class StepProbe(Hook):
    """At step `step`: each tensor's gradient norm (recomputed over the global batch a micro-batch at a time, as
    the engine does), its update norm, and each sample's loss."""

    def __init__(self, step: int, *, micro_batch: int) -> None:
        self.step, self.micro_batch = step, micro_batch
        self.before: dict[str, torch.Tensor] = {}
        self.grad_norms: dict[str, float] = {}
        self.update_norms: dict[str, float] = {}
        self.samples: list[dict[str, Any]] = []
        self.record: dict[str, Any] = {}

    def on_step_start(self, loop: TrainLoop) -> None:
        if loop.step != self.step - 1:
            return
        state = loop.train.state_dict()  # read the coming global batch, and put the cursor back
        batch = loop.train.next()
        indices = list(getattr(loop.train, "last_indices", []))
        loop.train.load_state_dict(state)
        model = loop.engine.model
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.before = {n: p.detach().clone() for n, p in params.items()}
        rows = batch[0].shape[0]
        sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        tokens_total, losses = 0.0, []
        for first in range(0, rows, self.micro_batch):
            part = tuple(t[first: first + self.micro_batch] for t in batch)
            loop.engine.dropout.at_rows(first)
            loss_sum, tokens = loop.loss_fn(model, part)
            grads = torch.autograd.grad(loss_sum, list(params.values()), allow_unused=True)
            for (name, _), grad in zip(params.items(), grads):
                if grad is not None:
                    sums[name] += grad.double()
            tokens_total += float(tokens)
            with torch.no_grad():
                for row in range(part[0].shape[0]):
                    one = tuple(t[row: row + 1] for t in part)
                    loop.engine.dropout.at_rows(first + row)
                    row_sum, row_tokens = loop.loss_fn(model, one)
                    losses.append((float(row_sum) / max(float(row_tokens), 1.0), float(row_tokens)))
        if loop.engine.router_log is not None:
            loop.engine.router_log.reset()  # the probe's forwards count no expert assignments
        self.grad_norms = {n: float(g.norm()) / max(tokens_total, 1.0) for n, g in sums.items()}
        self.samples = [{"row": row, "index": indices[row] if row < len(indices) else None, "loss": loss,
                         "tokens": tokens, "ids": batch[0][row].tolist()}
                        for row, (loss, tokens) in enumerate(losses)]

    def on_step_end(self, loop: TrainLoop, record: dict[str, Any]) -> None:
        if record.get("step") != self.step:
            return
        self.record = dict(record)
        for name, param in loop.engine.model.named_parameters():
            if name in self.before:
                self.update_norms[name] = float((param.detach().double() - self.before[name].double()).norm())
        raise StepReached(self.step)


def replay(args: Any) -> int:
    """`paratrain replay`: the report (text, or one JSON object with --json)."""
    from paratrain.config import check_run
    from paratrain.hf.load import run_model_shape
    from paratrain.topology import join, lay_out
    from paratrain.train.trainer import Trainer

    checkpoint = replay_checkpoint(args.checkpoint, args.step)
    config = replay_config(checkpoint, args.step, device=args.device)
    meta_config = json.loads((checkpoint / "meta.json").read_text())["config"]
    log = args.log or meta_config.get("train", {}).get("log_json", "")
    plan = check_run(config, 1, model_shape=run_model_shape)
    ctx = lay_out(join(config.launch.device), plan.parallel)
    probe = StepProbe(args.step, micro_batch=plan.batch.micro_batch)
    trainer = Trainer(plan, ctx, hooks=[probe])
    try:
        trainer.loop.run()
    except StepReached:
        pass
    logged = logged_step(log, args.step)
    report = {"step": args.step, "checkpoint": str(checkpoint), "loss": probe.record.get("loss"),
              "grad_norm": probe.record.get("grad_norm"),
              "logged_loss": logged.get("loss") if logged else None,
              "logged_grad_norm": logged.get("grad_norm") if logged else None, "log": log or None,
              "tensors": {name: {"grad_norm": probe.grad_norms.get(name), "update_norm": probe.update_norms.get(name)}
                          for name in probe.grad_norms},
              "samples": _worst(probe.samples, args.top, trainer.source),
              "spike_policy": meta_config.get("train", {}).get("spike_policy", "off")}
    if args.json:
        print(json.dumps(report))
    else:
        print(_text(report))
    return 0


def _worst(samples: list[dict[str, Any]], top: int, source: Any) -> list[dict[str, Any]]:
    """The `top` samples with the largest losses, with the start of their text where the data can be decoded."""
    chosen = sorted(samples, key=lambda s: -s["loss"])[:top]
    out = []
    for sample in chosen:
        entry = {k: sample[k] for k in ("row", "index", "loss", "tokens")}
        if source is not None and source.can_write:
            entry["text"] = source.decode(sample["ids"])[:200]
        out.append(entry)
    return out


def _text(report: dict[str, Any]) -> str:
    def number(value: Any) -> str:
        return "not logged" if value is None else f"{value:.9g}"

    lines = [f"step {report['step']} replayed on one process from {report['checkpoint']}",
             f"  loss       {number(report['loss'])}   logged {number(report['logged_loss'])}",
             f"  grad norm  {number(report['grad_norm'])}   logged {number(report['logged_grad_norm'])}"]
    if report["spike_policy"] != "off":
        lines.append(f"  the run had --spike-policy {report['spike_policy']}: a spike it undid between the checkpoint "
                     "and this step (its log names each) made it read other batches than this replay")
    if report["logged_loss"] is not None and report["loss"] is not None:
        rel = abs(report["loss"] - report["logged_loss"]) / max(abs(report["logged_loss"]), 1e-30)
        lines.append(f"  loss differs from the logged one by {rel:.2e} (relative)")
    tensors = sorted(report["tensors"].items(), key=lambda kv: -(kv[1]["grad_norm"] or 0.0))
    lines.append("  largest gradient norms (mean gradient, before clipping) and update norms:")
    for name, norms in tensors[:10]:
        update = norms["update_norm"]
        lines.append(f"    {name:<40} grad {norms['grad_norm']:.4e}   update "
                     f"{'-' if update is None or math.isnan(update) else f'{update:.4e}'}")
    lines.append("  samples with the largest losses:")
    for sample in report["samples"]:
        text = f"  {sample['text']!r}" if "text" in sample else ""
        lines.append(f"    sample {sample['index']} (row {sample['row']}): loss {sample['loss']:.4f} over "
                     f"{sample['tokens']:.0f} tokens{text}")
    return "\n".join(lines)
