"""Callbacks of paratrain.Trainer: code of yours run at fixed points of fit, on every rank.

Every rank calls them with the same records (losses are global, not per rank); guard what should
happen once (printing, writing files) with `trainer.is_main`.

Each hook is given the paratrain.Trainer running fit, typed here as TrainerView (what a callback
reads of it), so that this module and paratrain.fit.trainer, which takes Callbacks, do not import
each other.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from paratrain.fit.result import FitResult
from paratrain.train.loop import Hook, TrainLoop

if TYPE_CHECKING:
    from paratrain.hybrid import Engine
    from paratrain.topology import Context


class TrainerView(Protocol):
    """The paratrain.Trainer a callback is called with, as far as callbacks read it."""

    @property
    def is_main(self) -> bool:
        """Rank 0 of the job (True before fit has started one)."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps done (0 before fit)."""
        ...

    @property
    def engine(self) -> Engine | None:
        """This rank's part of the model and its optimizer (None before fit)."""
        ...

    @property
    def ctx(self) -> Context | None:
        """The job's mesh and device (None before fit)."""
        ...


class Callback:
    """Override the hooks you need; each default does nothing."""

    def on_fit_start(self, trainer: TrainerView) -> None:
        """After the layout is applied and a checkpoint resumed, before the first step."""

    def on_train_step_end(self, trainer: TrainerView, record: dict[str, Any]) -> None:
        """After each optimizer step: the step's JSON record (step, loss, grad_norm, lr, tokens,
        step_time, tokens_per_s, and val_loss on a validation step)."""

    def on_validation_end(self, trainer: TrainerView, step: int, val_loss: float) -> None:
        """After each validation pass (step 0: before training)."""

    def on_fit_end(self, trainer: TrainerView, result: FitResult) -> None:
        """After the last step (and its checkpoint)."""


class PrintProgress(Callback):
    """One line every `every` steps on rank 0: step, loss, validation loss, samples per second."""

    def __init__(self, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def on_train_step_end(self, trainer: TrainerView, record: dict[str, Any]) -> None:
        if trainer.is_main and (record["step"] % self.every == 0 or "val_loss" in record):
            val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            print(f"step {record['step']:>6}  loss {record['loss']:.4f}{val}  {record['tokens_per_s']:,.0f} /s",
                  file=sys.stderr, flush=True)


class CallbackHooks(Hook):
    """The user's Callbacks (called with the Trainer, as Lightning's are) as hooks of the loop."""

    def __init__(self, trainer: TrainerView, callbacks: Sequence[Callback]) -> None:
        self.trainer, self.callbacks = trainer, callbacks

    def on_start(self, loop: TrainLoop) -> None:
        for callback in self.callbacks:
            callback.on_fit_start(self.trainer)

    def on_step_end(self, loop: TrainLoop, record: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.on_train_step_end(self.trainer, record)

    def on_validation_end(self, loop: TrainLoop, step: int, val_loss: float) -> None:
        for callback in self.callbacks:
            callback.on_validation_end(self.trainer, step, val_loss)
