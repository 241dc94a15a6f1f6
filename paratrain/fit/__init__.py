"""paratrain.Trainer: a Lightning-style front door (devices, strategy, fit) to the engine."""

from paratrain.fit.callbacks import Callback, PrintProgress
from paratrain.fit.trainer import STRATEGIES, FitResult, Trainer, strategy_config

__all__ = ["STRATEGIES", "Callback", "FitResult", "PrintProgress", "Trainer", "strategy_config"]
