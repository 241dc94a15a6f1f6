"""Memory savers: activation recomputation, the precision policy, loss scaling."""

from paratrain.memory.activations import ActivationMeter, SavedActivations, saved_activations
from paratrain.memory.precision import LOW_DTYPES, PRECISIONS, LossScaler, autocast
from paratrain.memory.recompute import GPT_BLOCKS, apply_recompute

__all__ = ["GPT_BLOCKS", "ActivationMeter", "LOW_DTYPES", "PRECISIONS", "LossScaler", "SavedActivations", "apply_recompute", "autocast",
           "saved_activations"]
