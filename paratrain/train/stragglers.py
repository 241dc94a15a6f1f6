"""Straggler detection (train.straggler_factor, `--straggler-factor F`): the rank that slows the job, named.

In a synchronous job every rank waits for the slowest at each collective, so the step time says that some rank is
slow and not which. Each rank knows better: its time between two steps splits into time blocked in collectives
(the flight recorder counts every blocking call and every wait on one in flight, paratrain.comm) and the rest,
its busy time. A straggler is busy longer, and its peers spend that difference waiting for it. After each step the
ranks share their busy times (one all-gather of two numbers each); a rank whose median busy time over the last K
steps (train.straggler_steps) is more than F times the median of the others' is named in the log, with its busy
and waiting times and the others' median, once until it recovers. The first K steps (allocation, caches) are not
judged. The median over K steps keeps a few noisy steps
from naming anyone: on this 2-core CPU, unslowed steps of 17 ms run 1.6x longer on one rank for 3 steps in a row
now and then; a rank slowed by 50 ms a step is 4.5x. Its cost: the all-gather each step (within
this machine's noise on 20 ms steps: docs/forensics.md).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.collectives import all_gather_async
from paratrain.topology.mesh import AxisGroup
from paratrain.train.loop import Hook, TrainLoop


class StragglerWatch(Hook):
    def __init__(self, factor: float, steps: int) -> None:
        self.factor, self.steps = factor, steps
        self.world: AxisGroup | None = None
        self._mark = 0.0
        self._waited = 0.0
        self._recent: dict[int, deque[tuple[float, float]]] = {}
        self._flagged: set[int] = set()
        self.named: list[dict[str, Any]] = []
        """Every naming: step, rank, its busy and waiting ms, the others' median busy ms."""

    def on_start(self, loop: TrainLoop) -> None:
        size = loop.ctx.world_size
        # the world's default group, outside the recorder: the wait in this exchange is not the job's
        self.world = AxisGroup("world", tuple(range(size)), loop.ctx.rank, dist.group.WORLD, None)
        self._restart(loop)

    def _restart(self, loop: TrainLoop) -> None:
        recorder = loop.ctx.mesh.recorder
        self._mark, self._waited = time.perf_counter(), recorder.waited_s if recorder is not None else 0.0

    def on_step_start(self, loop: TrainLoop) -> None:
        if loop.step <= self.steps or self.world is None or self.world.size == 1:  # after K steps of warm-up
            self._restart(loop)
            return
        recorder = loop.ctx.mesh.recorder
        elapsed = time.perf_counter() - self._mark
        waited = (recorder.waited_s if recorder is not None else 0.0) - self._waited
        mine = torch.tensor([elapsed - waited, waited], dtype=torch.float64, device=loop.ctx.device)
        everyone = torch.empty(self.world.size, 2, dtype=torch.float64, device=loop.ctx.device)
        all_gather_async(everyone.view(-1), mine, self.world).wait()
        self._judge(loop, loop.step, everyone.tolist())
        self._restart(loop)  # after the exchange: the wait in it belongs to no step

    def _judge(self, loop: TrainLoop, step: int, times: list[list[float]]) -> None:
        for rank, (busy, waited) in enumerate(times):
            self._recent.setdefault(rank, deque(maxlen=self.steps)).append((busy, waited))
        if len(self._recent[0]) < self.steps:
            return
        medians = [statistics.median(b for b, _ in self._recent[r]) for r in range(len(times))]
        for rank, mine in enumerate(medians):
            others = statistics.median(medians[:rank] + medians[rank + 1:])
            if mine <= self.factor * others:
                self._flagged.discard(rank)
                continue
            if rank in self._flagged:  # named once a streak
                continue
            self._flagged.add(rank)
            waited = statistics.median(w for _, w in self._recent[rank])
            event = {"step": step, "rank": rank, "busy_ms": 1e3 * mine, "waiting_ms": 1e3 * waited,
                     "others_busy_ms": 1e3 * others}
            self.named.append(event)
            if loop.ctx.is_main:
                loop.log.warning("straggler: rank %d was busy %.1f ms a step over the last %d steps (median), "
                                 "%.1fx the others' median of %.1f ms (--straggler-factor %g), waiting %.1f ms in "
                                 "collectives; at step %d", rank, 1e3 * mine, self.steps, mine / max(others, 1e-9),
                                 1e3 * others, self.factor, 1e3 * waited, step)
