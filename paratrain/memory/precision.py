"""Precision policy: which dtype computes. Weights, gradients and optimizer state stay float32."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: torch.device) -> ContextManager[object]:
    """bf16: matmuls in bfloat16 under torch.autocast (CPU and CUDA); fp32: nothing changes."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
