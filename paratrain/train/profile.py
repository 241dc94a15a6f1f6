"""Profiling (train.profile, `--profile STEPS`): torch.profiler traces of a few steps, one file per rank.

The steps after the first (which compiles, allocates and warms the caches) are recorded: a step of wait, a step of
warm-up, then STEPS active steps, by torch.profiler's schedule; the trace is written by its TensorBoard handler
(`RANK.*.pt.trace.json` under train.profile_dir: the Chrome trace format that TensorBoard's profiler plugin,
Perfetto and chrome://tracing read), CPU activity and, on CUDA, the kernels, with shapes and memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from paratrain.train.loop import Hook, TrainLoop


class StepProfiler(Hook):
    def __init__(self, steps: int, folder: str) -> None:
        self.steps, self.folder = steps, folder
        self.profiler: profile | None = None
        self._started = False

    def on_start(self, loop: TrainLoop) -> None:
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if loop.ctx.device.type == "cuda" else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=self.steps, repeat=1),
                                on_trace_ready=tensorboard_trace_handler(self.folder, worker_name=f"rank{loop.ctx.rank}"),
                                record_shapes=True, profile_memory=True)
        self.profiler.__enter__()

    def on_step_start(self, loop: TrainLoop) -> None:
        if self.profiler is not None and self._started:  # a step boundary (the first step opens the schedule)
            self.profiler.step()
        self._started = True

    def on_end(self, loop: TrainLoop, result: Any) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None
            if loop.ctx.device.type == "cuda":
                torch.cuda.synchronize()
