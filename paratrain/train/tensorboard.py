"""The per-step records as TensorBoard scalars (torch.utils.tensorboard; `pip install 'paratrain[viz]'`).

Tags: train/loss, train/lr, train/grad_norm, train/loss_scale, val/loss, perf/tokens_per_s,
perf/step_time, perf/mfu, and memory/<part>_mib from the first step's memory record. The step axis is
the optimizer step, as in the JSON log.
"""

from __future__ import annotations

from typing import Any

from paratrain.config.errors import ConfigError

TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "loss_scale": "train/loss_scale",
        "val_loss": "val/loss", "tokens_per_s": "perf/tokens_per_s", "step_time": "perf/step_time", "mfu": "perf/mfu"}


class TensorBoardLog:
    def __init__(self, folder: str, *, resumed_at: int = 0) -> None:
        """resumed_at: a run that continues from this step: TensorBoard drops the events an earlier
        attempt wrote after it (those steps are about to run again)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"--tensorboard {folder}: the tensorboard package is not installed: "
                              "pip install 'paratrain[viz]' (or tensorboard)") from None
        self._writer = SummaryWriter(folder, purge_step=resumed_at + 1 if resumed_at else None)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, tag in TAGS.items():
            if key in record and record[key] is not None:
                self._writer.add_scalar(tag, float(record[key]), step)
        for part, nbytes in record.get("memory", {}).items():
            self._writer.add_scalar(f"memory/{part}_mib", nbytes / 2**20, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
