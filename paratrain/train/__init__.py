"""The training loop: Trainer, learning-rate schedule, optimizer groups, metrics and the JSON log."""

from paratrain.train.metrics import JsonLog, mfu, peak_flops
from paratrain.train.optim import adamw_factory, optimizer_factory
from paratrain.train.schedule import lr_at
from paratrain.train.trainer import Trainer, TrainResult, check_data

__all__ = ["JsonLog", "TrainResult", "Trainer", "adamw_factory", "check_data", "optimizer_factory", "lr_at", "mfu", "peak_flops"]
