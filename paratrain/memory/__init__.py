"""Memory savers: activation recomputation, the precision policy, loss scaling."""

from paratrain.memory.activations import ActivationMeter, SavedActivations, live_tensor_bytes, saved_activations
from paratrain.memory.offload import ActivationOffload, OffloadStats, apply_activation_offload
from paratrain.memory.precision import LOW_DTYPES, PRECISIONS, LossScaler, autocast
from paratrain.memory.recompute import RECOMPUTE_MODES, apply_recompute, recompute_pattern

__all__ = ["ActivationOffload", "OffloadStats", "apply_activation_offload", "RECOMPUTE_MODES", "recompute_pattern", "ActivationMeter", "LOW_DTYPES", "PRECISIONS", "LossScaler", "SavedActivations", "apply_recompute", "autocast",
           "live_tensor_bytes", "saved_activations"]
