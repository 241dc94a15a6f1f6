"""Memory savers: activation recomputation and the precision policy."""

from paratrain.memory.precision import PRECISIONS, autocast
from paratrain.memory.recompute import GPT_BLOCKS, apply_recompute

__all__ = ["GPT_BLOCKS", "PRECISIONS", "apply_recompute", "autocast"]
