"""Memory savers: activation recomputation, the precision policy, loss scaling."""

from paratrain.memory.precision import LOW_DTYPES, PRECISIONS, LossScaler, autocast
from paratrain.memory.recompute import GPT_BLOCKS, apply_recompute

__all__ = ["GPT_BLOCKS", "LOW_DTYPES", "PRECISIONS", "LossScaler", "apply_recompute", "autocast"]
