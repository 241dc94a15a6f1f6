"""Fault injection: crashes (train.fail_at, `--fail-at`) and faults a run survives (train.inject, `--inject`; Injection
below), as loop hooks.

    RANK:STEP              that rank raises at that step
    RANK:STEP:kill         that rank SIGKILLs itself (as the out-of-memory killer or `kill -9` would)
    RANK:STEP:kill-backward  the same, in the middle of that step's backward (the first gradient it computes)
    RANK:STEP:hang         that rank stops answering (its peers time out in a collective)
    RANK:STEP:kill-saving  SIGKILL while saving the checkpoint of STEP (its own file written, unpublished)
    RANK:STEP:kill-node    SIGKILL its whole node: its launcher and every worker of it (Linux), once every
                           rank's asynchronous save in flight is written (each rank waits for its own writer
                           at that step, then for every other rank: the job has a checkpoint to come back to,
                           whatever the disk's speed)

Only the first attempt of a job fails: a relaunch (--max-restarts) runs clean. A dedicated parameter
server's RANK fails before it applies that step's update.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from paratrain.train.loop import Hook, TrainLoop


class FaultInjection(Hook):
    def __init__(self, fail_at: str, *, rank: int, attempt: int) -> None:
        rank_text, step_text, *how = fail_at.split(":")
        self.rank, self.step, self.how = int(rank_text), int(step_text), how
        self.armed = self.rank == rank and attempt == 0
        self.first_attempt = attempt == 0

    def on_step_start(self, loop: TrainLoop) -> None:
        if self.first_attempt and self.how == ["kill-node"] and self.step == loop.step + 1 and loop.saver is not None:
            loop.saver.wait()  # on every rank: the save in flight written (and copied) before the node dies
            if torch.distributed.is_initialized():  # and every rank's, not only the killer's (it was a race)
                torch.distributed.barrier()
        if self.armed and self.how == ["kill-backward"] and self.step == loop.step + 1:
            for param in loop.engine.model.parameters():  # the first gradient of the step's backward kills
                if param.requires_grad:
                    param.register_hook(_kill)
                    break
            return
        self.at_step(loop.step + 1)

    def at_step(self, step: int) -> None:
        """Before step `step` (1-based) runs on this rank: a trainer's loop, or a parameter server about to
        apply that step's update."""
        if not self.armed or self.how == ["kill-saving"] or self.step != step:
            return
        if self.how == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.how == ["kill-node"]:
            _kill_node()
        while self.how == ["hang"]:
            time.sleep(1.0)
        raise RuntimeError(f"injected fault (train.fail_at) on rank {self.rank} at step {self.step}")

    def before_publish(self, loop: TrainLoop) -> None:
        if self.armed and self.how == ["kill-saving"] and self.step == loop.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _kill(grad: torch.Tensor) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_node() -> None:
    """SIGKILL this worker's launcher (its parent), its sibling workers, then itself (Linux /proc)."""
    launcher = os.getppid()
    victims = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == launcher and int(stat.parent.name) != os.getpid():  # fields[1]: the parent's pid
            victims.append(int(stat.parent.name))
    for pid in [launcher, *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone already, or not ours to kill
            pass
    os.kill(os.getpid(), signal.SIGKILL)


INJECTIONS = ("bitflip", "slow", "spike")


class Injection(Hook):
    """Faults that a run survives but must notice (train.inject, `--inject`), each what a forensics tool is tested
    against:

        bitflip:RANK:STEP   flip one bit (the highest of the mantissa) of the first element of RANK's first reduced
                            gradient at STEP, after the reduction and before the update: silent corruption on one
                            replica (paratrain.train.replicas names it)
        slow:RANK:MS        RANK sleeps MS milliseconds before each step (paratrain.train.stragglers names it)
        spike:STEP          the global batch of STEP is replaced by a corrupted one (every target one id; the same
                            on every rank): a loss spike (the spike policy acts on it)
    """

    def __init__(self, spec: str, *, rank: int) -> None:
        kind, *numbers = spec.split(":")
        self.kind, self.rank = kind, rank
        self.target_rank = int(numbers[0]) if kind in ("bitflip", "slow") else -1
        self.step = int(numbers[1]) if kind == "bitflip" else int(numbers[0]) if kind == "spike" else 0
        self.ms = int(numbers[1]) if kind == "slow" else 0
        self._coming = 0

    def on_start(self, loop: TrainLoop) -> None:
        if self.kind == "bitflip" and self.rank == self.target_rank:
            loop.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._flip(optimizer))

    def on_step_start(self, loop: TrainLoop) -> None:
        self._coming = loop.step + 1
        if self.kind == "slow" and self.rank == self.target_rank:
            time.sleep(self.ms / 1000.0)

    def on_batch(self, loop: TrainLoop, batch: Any) -> Any:
        if self.kind != "spike" or self._coming != self.step:
            return batch
        inputs, targets, *rest = batch
        return (inputs, torch.where(targets >= 0, torch.full_like(targets, 1), targets), *rest)

    def _flip(self, optimizer: torch.optim.Optimizer) -> None:
        if self._coming != self.step:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None and param.grad.numel():
                    flat = param.grad.view(-1)
                    bits = flat[:1].view(torch.int32) if flat.dtype == torch.float32 else None
                    if bits is None:
                        flat[0] = -2.0 * flat[0] - 1.0  # not float32: a change as large
                    else:
                        bits ^= 1 << 22
                    return


def injections(specs: str, *, rank: int) -> list[Injection]:
    """The hooks of a comma-separated train.inject ('' -> none)."""
    return [Injection(spec.strip(), rank=rank) for spec in specs.split(",") if spec.strip()]


class SkipBatches(Hook):
    """train.skip_batches: each listed global batch is read and dropped, its step training on the next one (a run
    that never saw those batches, layout-free like every read)."""

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches
        self.read = 0

    def on_start(self, loop: TrainLoop) -> None:
        self.read = loop.step + sum(1 for b in self.batches if b <= loop.step)  # read before a resume

    def on_batch(self, loop: TrainLoop, batch: Any) -> Any:
        self.read += 1
        while self.read in self.batches:
            batch = loop.train.next()
            self.read += 1
        return batch
