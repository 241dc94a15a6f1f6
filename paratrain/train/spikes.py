"""Loss spikes (train.spike_policy, `--spike-policy skip|rollback`): a step whose loss jumps is undone.

A step's loss is a spike when it exceeds the median of the last 5 accepted losses by more than `sigma` times the
standard deviation of the step-to-step changes over the last `window` accepted losses (after 10 of them): a measure
of the noise that a falling loss does not inflate, as a plain standard deviation of the losses would (early in a
run the trend is most of it). Before each step the hook keeps the whole state in
memory (Engine.state_dict(): the model, the optimizer state, the dropout step; and the loader's cursor), so a
spike can be undone exactly:

    skip       the state goes back to before the step: its update is dropped, its step number and batch are
               spent (the next step is S + 1, on batch S + 1)
    rollback   the state goes back to before the step and the step is taken again on the next batch: the batch
               that spiked is skipped, and the run goes on exactly as a run that never saw it
               (`--skip-batches S`; tests/e2e/test_cli.py::test_a_spike_is_rolled_back)

Each event is logged on rank 0 with its step, loss, threshold and the batch skipped; `paratrain replay` of the step
shows its samples. The cost: a copy of the state each step (Engine.state_dict gathers the whole model on every
rank: for models that fit a rank's memory twice; memory-light snapshots are not built).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

import torch

from paratrain.train.faults import SkipBatches
from paratrain.train.loop import TrainLoop

POLICIES = ("off", "skip", "rollback")


def _copied(value: Any) -> Any:
    """A deep copy of the tensors of a state dict (Engine.state_dict may share storage with the live model)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


class SpikePolicy(SkipBatches):
    """SkipBatches whose set grows by every batch a rollback skips."""

    def __init__(self, policy: str, *, sigma: float, window: int, skipped: set[int] = frozenset()) -> None:
        """skipped: global batches skipped from the start (train.skip_batches)."""
        super().__init__(set(skipped))
        self.policy, self.sigma = policy, sigma
        self.losses: deque[float] = deque(maxlen=window)
        self.history = 10
        self._snapshot: tuple[int, int, dict[str, Any], dict[str, Any]] | None = None
        self.events: list[dict[str, Any]] = []

    def on_step_start(self, loop: TrainLoop) -> None:
        self._snapshot = (loop.step, self.read, _copied(loop.engine.state_dict()), loop.train.state_dict())

    def on_step_end(self, loop: TrainLoop, record: dict[str, Any]) -> None:
        loss = record.get("loss")
        if loss is None or record.get("step") != loop.step:
            return
        if len(self.losses) >= self.history:
            recent = list(self.losses)
            noise = statistics.pstdev([b - a for a, b in zip(recent, recent[1:])])
            threshold = statistics.median(recent[-5:]) + self.sigma * noise
            if loss > threshold:
                self._undo(loop, loss, threshold)
                return
        self.losses.append(loss)

    def _undo(self, loop: TrainLoop, loss: float, threshold: float) -> None:
        assert self._snapshot is not None
        step, read, state, cursor = self._snapshot
        spiked = self.read
        loop.engine.load_state_dict(state)
        event = {"step": loop.step, "loss": loss, "threshold": threshold, "batch": spiked, "policy": self.policy}
        self.events.append(event)
        if self.policy == "rollback":  # the same step again, on the batch after the one that spiked
            self.batches.add(spiked)
            loop.train.load_state_dict(cursor)
            loop.step, self.read = step, read
        else:  # skip: the step is spent, its update dropped (the dropout stream moves on as a step would)
            loop.engine.dropout.advance()
        if loop.ctx.is_main:
            loop.log.warning("loss spike at step %d: %.4f over the threshold %.4f (the recent median + %g x the noise "
                             "of the last %d losses); %s (global batch %d); `paratrain replay` shows its samples",
                             event["step"],
                             loss, threshold, self.sigma, len(self.losses),
                             "rolled back, the batch skipped" if self.policy == "rollback" else "update skipped",
                             spiked)
