"""Pictures of runs and plans (matplotlib; `pip install 'paratrain[viz]'`).

    paratrain plot RUN.jsonl [RUN2.jsonl ...] -o curves.png
    paratrain plan --model gpt3-xl --gpus 16 --global-batch 512 --plot plan.png

plot_runs draws the training loss (lines) and validation loss (dots) of each run's `--log-json` records on one
figure; plot_scaling wall time and accuracy against the process count (paratrain scaling); plot_plan the per-rank
memory of the planner's top layouts and the pipeline schedule of the best one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from paratrain.config.errors import ConfigError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'paratrain[viz]' (or matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON records of a --log-json file (or a paratrain.Trainer's log_json)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (give the files written by --log-json)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON record ({error})") from None
    return records


def plot_runs(paths: Sequence[str | Path], out: str | Path, *, labels: Sequence[str] | None = None,
              log_y: bool = False) -> Path:
    """One figure: each run's training loss by step, and its validation loss as dots of the same colour."""
    labels = list(labels) if labels else [Path(p).stem for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} runs")
    curves = {}
    for path, label in zip(paths, labels):
        records = read_records(path)
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if not train and not val:
            raise ValueError(f"{path}: no record holds a loss or val_loss")
        curves[label] = (train, val)
    return plot_curves(curves, out, log_y=log_y)


def plot_curves(curves: dict[str, tuple[list[tuple[int, float]], list[tuple[int, float]]]], out: str | Path, *,
                log_y: bool = False, title: str = "") -> Path:
    """label -> ([(step, training loss)], [(step, validation loss)]) on one figure."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, (train, val) in curves.items():
        line = axes.plot(*zip(*train), label=f"{label} (train)", linewidth=1.2)[0] if train else None
        if val:
            axes.plot(*zip(*val), "o--", color=line.get_color() if line else None, markersize=4,
                      label=f"{label} (validation)")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    if log_y:
        axes.set_yscale("log")
    if title:
        axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return _save(plt, figure, out)


def _save(plt: Any, figure: Any, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def plot_scaling(runs: Sequence[dict[str, Any]], out: str | Path, *, title: str = "") -> Path:
    """Two panels, one line per mode: wall time and accuracy against processes (paratrain scaling's runs)."""
    plt = _pyplot()
    figure, (time_axes, accuracy_axes) = plt.subplots(1, 2, figsize=(11, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["procs"])
        procs = [r["procs"] for r in mine]
        time_axes.plot(procs, [r["wall_s"] for r in mine], "o-", label=mode)
        accuracy_axes.plot(procs, [100 * r["accuracy"] for r in mine], "o-", label=mode)
    counts = sorted({r["procs"] for r in runs})
    for axes, label in ((time_axes, "wall time of training (s)"), (accuracy_axes, "test accuracy (%)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(counts, labels=[str(c) for c in counts])
        axes.minorticks_off()
        axes.set_xlabel("processes")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return _save(plt, figure, out)


MEMORY_PARTS = ("params", "grads", "optimizer", "activations")


def plot_plan(record: dict[str, Any], out: str | Path, *, global_batch: int, top: int = 8) -> Path:
    """Two panels from a `paratrain plan` record (planner.search's): the busiest rank's memory of the top layouts,
    stacked by what holds it against the device's memory; and the best layout's pipeline schedule, each pipeline
    rank's forward / backward of each micro-batch on a time line (the schedule run in simulated time at the
    planner's compute time per micro-batch; the blank between bars is the bubble)."""
    from paratrain.pipeline.schedules import Schedule
    from paratrain.pipeline.simulate import simulate

    plt = _pyplot()
    candidates = record["candidates"][:top]
    if not candidates:
        raise ValueError("the plan has no candidate layout to draw (every layout was refused)")
    figure, (memory_axes, gantt) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1, 1.4]})
    names = [_layout_label(c["layout"]) for c in candidates]
    bottom = [0.0] * len(candidates)
    for part in MEMORY_PARTS:
        values = [c["memory"].get(part, 0) / 1e9 for c in candidates]
        memory_axes.barh(names, values, left=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    others = [c["memory"]["peak"] / 1e9 - b for c, b in zip(candidates, bottom)]
    memory_axes.barh(names, [max(o, 0.0) for o in others], left=bottom, label="other (buffers, transient)")
    memory_axes.axvline(record["hardware"]["memory_bytes"] / 1e9, color="black", linestyle="--", label="device")
    memory_axes.invert_yaxis()
    memory_axes.set_xlabel("GB on the busiest rank (peak)")
    memory_axes.legend(fontsize=8, loc="lower right")
    best = candidates[0]["layout"]
    stages, chunks = best["pp"], best["virtual_stages"]
    microbatches = global_batch // (best["dp"] * best["micro_batch"])
    events: list[tuple[int, str, int, int, float, float]] = []
    # the pipelined compute (the optimizer step runs once, after the schedule), per stage and micro-batch: a
    # forward, and backward twice it
    pipelined = candidates[0]["compute_s"] - candidates[0].get("terms", {}).get("optimizer step", 0.0)
    forward = pipelined / (3 * microbatches)
    costs = {"F": forward, "B": 2 * forward, "I": forward, "W": forward}
    schedule = Schedule(best["schedule"], stages, chunks)
    simulate([schedule.program(r, microbatches) for r in range(stages)], schedule, microbatches=microbatches,
             costs=costs, events=events)
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    edges = {"edgecolor": "white", "linewidth": 0.5} if len(events) <= 400 else {"linewidth": 0}
    for rank, kind, chunk, mb, start, end in events:
        gantt.barh(rank, end - start, left=start, color=colors[kind], **edges)
        if microbatches <= 16:
            gantt.text((start + end) / 2, rank, str(mb), ha="center", va="center", fontsize=6, color="white")
    gantt.set_yticks(range(stages), labels=[f"stage {r}" for r in range(stages)])
    gantt.invert_yaxis()
    gantt.set_xlabel("seconds of the step's compute (simulated)")
    gantt.set_title(f"{names[0]}: {best['schedule']}, {microbatches} micro-batches "
                    f"(F blue, B / I orange, W green)", fontsize=9)
    figure.tight_layout()
    return _save(plt, figure, out)


def _layout_label(layout: dict[str, Any]) -> str:
    text = f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']} z{layout['zero']} mb{layout['micro_batch']}"
    return text + (f" {layout['recompute']}" if layout.get("recompute", "none") != "none" else "")
