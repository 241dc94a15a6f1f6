"""Fault injection for testing crash handling (train.fail_at, `--fail-at`): a loop hook.

    RANK:STEP              that rank raises at that step
    RANK:STEP:kill         that rank SIGKILLs itself (as the out-of-memory killer or `kill -9` would)
    RANK:STEP:hang         that rank stops answering (its peers time out in a collective)
    RANK:STEP:kill-saving  SIGKILL while saving the checkpoint of STEP (its own file written, unpublished)
    RANK:STEP:kill-node    SIGKILL its whole node: its launcher and every worker of it (Linux)

Only the first attempt of a job fails: a relaunch (--max-restarts) runs clean. A dedicated parameter
server's RANK fails before it applies that step's update.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from paratrain.train.loop import Hook, TrainLoop


class FaultInjection(Hook):
    def __init__(self, fail_at: str, *, rank: int, attempt: int) -> None:
        rank_text, step_text, *how = fail_at.split(":")
        self.rank, self.step, self.how = int(rank_text), int(step_text), how
        self.armed = self.rank == rank and attempt == 0

    def on_step_start(self, loop: TrainLoop) -> None:
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
