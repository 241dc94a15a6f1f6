"""The planner: per-rank memory and step time of a layout, before anything is launched, and a search
over layouts. Pure: no process group, no device memory (shapes only, on the meta device)."""

from paratrain.planner.hardware import PROFILES, Hardware, hardware
from paratrain.planner.layout import Layout
from paratrain.planner.search import candidates, check_layout, estimate, memory, search
from paratrain.planner.textbook import (
    bubble_fraction,
    korthikanti_activation_bytes,
    training_days,
    zero_model_state_bytes,
)

__all__ = [
    "PROFILES", "Hardware", "Layout", "bubble_fraction", "candidates", "check_layout", "estimate", "hardware",
    "korthikanti_activation_bytes", "memory", "search", "training_days", "zero_model_state_bytes",
]
