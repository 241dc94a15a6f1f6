"""paratrain.Trainer: a Lightning-style front door (devices, strategy, fit) to the engine."""

from paratrain.fit.callbacks import Callback, PrintProgress, TrainerView
from paratrain.fit.result import FitResult
from paratrain.fit.strategy import STRATEGIES, strategy_config
from paratrain.fit.trainer import Trainer

__all__ = ["STRATEGIES", "Callback", "FitResult", "PrintProgress", "Trainer", "TrainerView", "strategy_config"]
