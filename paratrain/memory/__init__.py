"""Memory savers: activation recomputation, the precision policy, loss scaling."""

from paratrain.memory.activations import ActivationMeter, SavedActivations, live_tensor_bytes, saved_activations
from paratrain.memory.float8 import FLOAT8_RECIPES, ScaleLog
from paratrain.memory.float8_linears import Float8Settings, apply_float8
from paratrain.memory.offload import ActivationOffload, OffloadStats, apply_activation_offload
from paratrain.memory.precision import POLICIES, PRECISIONS, LossScaler, Precision, precision_policy
from paratrain.memory.recompute import RECOMPUTE_MODES, apply_recompute, recompute_pattern

__all__ = ["ActivationMeter", "ActivationOffload", "FLOAT8_RECIPES", "Float8Settings", "LossScaler", "OffloadStats",
           "POLICIES", "PRECISIONS", "Precision", "ScaleLog", "apply_float8",
           "RECOMPUTE_MODES", "SavedActivations", "apply_activation_offload", "apply_recompute", "live_tensor_bytes",
           "precision_policy", "recompute_pattern", "saved_activations"]
