"""FitResult: what paratrain.Trainer.fit returns (and a launching Trainer receives from its workers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FitResult:
    losses: dict[int, float] = field(default_factory=dict)
    """Global-batch training loss by step (1-based): the steps this fit ran (after a resume or a
    relaunch, those after the checkpoint; log_json= keeps every step once)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss by step (0: before training)."""
    wall_s: float = 0.0
    """Seconds from the first step to the end of the last, on rank 0."""
