"""Memory at one step, and at an out-of-memory error (train.memory_snapshot, `--memory-snapshot STEP`).

Each rank writes, after step STEP (or when a step runs out of device memory before it), beside the profiles
(train.profile_dir):

    rankR-stepS.memory.json   what the rank measured (Engine.memory_report(): parameters, gradients, optimizer
                              state; on CUDA the allocator's peak and current bytes) beside the planner's prediction
                              for the run's layout (paratrain.planner: the same parts, activations and peak)
    rankR-stepS.pickle        on CUDA, the caching allocator's history (torch.cuda.memory._record_memory_history,
                              recorded from the first step): drag it into https://pytorch.org/memory_viz

On the CPU there is no allocator history to record (the JSON is written all the same); a CPU process out of memory
is killed by the operating system, which no handler sees. An out-of-memory error on CUDA writes both files for the
step it happened in, then the run stops as it would have, the error naming them.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any, Mapping

import torch

from paratrain.train.loop import Hook, TrainLoop


class MemorySnapshot(Hook):
    def __init__(self, step: int, folder: str, predicted: Mapping[str, float] | None) -> None:
        """predicted: the planner's bytes for this run's busiest rank (None: no prediction, e.g. a --hf model)."""
        self.step, self.folder, self.predicted = step, Path(folder), predicted
        self.recording = False
        self.written: list[Path] = []

    def on_start(self, loop: TrainLoop) -> None:
        if loop.ctx.device.type == "cuda" and loop.step < self.step:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.recording = True

    def on_step_end(self, loop: TrainLoop, record: dict[str, Any]) -> None:
        if record.get("step") == self.step:
            self.write(loop, self.step, reason="the step asked for")

    def on_error(self, loop: TrainLoop, error: BaseException) -> None:
        if isinstance(error, torch.OutOfMemoryError):
            self.write(loop, loop.step + 1, reason=f"out of memory: {str(error).splitlines()[0][:200]}")

    def write(self, loop: TrainLoop, step: int, *, reason: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"rank{loop.ctx.rank}-step{step}"
        measured: dict[str, Any] = dict(loop.engine.memory_report())
        if loop.ctx.device.type == "cuda":
            measured.update(allocated=torch.cuda.memory_allocated(), peak_allocated=torch.cuda.max_memory_allocated(),
                            reserved=torch.cuda.memory_reserved())
        measured["process_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        report = {"rank": loop.ctx.rank, "step": step, "reason": reason, "device": loop.ctx.device.type,
                  "measured": measured, "predicted": dict(self.predicted) if self.predicted is not None else None,
                  "allocator_history": f"{stem.name}.pickle" if self.recording else
                  "CUDA only (torch.cuda.memory._record_memory_history)"}
        path = stem.with_suffix(".memory.json")
        path.write_text(json.dumps(report, indent=1))
        self.written.append(path)
        if self.recording:
            torch.cuda.memory._dump_snapshot(str(stem.with_suffix(".pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
        if loop.ctx.is_main:
            loop.log.info("memory at step %d (%s): %s", step, reason, path)
