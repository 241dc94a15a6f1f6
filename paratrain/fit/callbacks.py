"""Callbacks of paratrain.Trainer: code of yours run at fixed points of fit, on every rank.

Every rank calls them with the same records (losses are global, not per rank); guard what should
happen once (printing, writing files) with `trainer.is_main`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.fit.trainer import FitResult, Trainer


class Callback:
    """Override the hooks you need; each default does nothing."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """After the layout is applied and a checkpoint resumed, before the first step."""

    def on_train_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After each optimizer step: the step's JSON record (step, loss, grad_norm, lr, tokens,
        step_time, tokens_per_s, and val_loss on a validation step)."""

    def on_validation_end(self, trainer: Trainer, step: int, val_loss: float) -> None:
        """After each validation pass (step 0: before training)."""

    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None:
        """After the last step (and its checkpoint)."""


class PrintProgress(Callback):
    """One line every `every` steps on rank 0: step, loss, validation loss, samples per second."""

    def __init__(self, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def on_train_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.is_main and (record["step"] % self.every == 0 or "val_loss" in record):
            val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            print(f"step {record['step']:>6}  loss {record['loss']:.4f}{val}  {record['tokens_per_s']:,.0f} /s",
                  file=sys.stderr, flush=True)
