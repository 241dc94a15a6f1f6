"""Activation recomputation, applied from outside to modules chosen by name.

A wrapped module keeps only its inputs in forward and recomputes its internals in backward
(torch.utils.checkpoint, non-reentrant). The forward is replaced on the instance rather than by
wrapping the module in another one, so parameter names, and with them checkpoints and TP plans,
stay exactly the model's own.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

# Blocks of the reference GPT: "blocks.0", "blocks.1", ...
GPT_BLOCKS = r"blocks\.\d+"


def apply_recompute(model: nn.Module, pattern: str = GPT_BLOCKS, *, required: bool = True) -> list[str]:
    """Recompute every module whose full name matches `pattern`; returns the names wrapped.
    required: a pattern that matches nothing is an error (a pipeline stage may hold no block)."""
    wrapped = []
    for name, module in model.named_modules():
        if name and re.fullmatch(pattern, name) and not getattr(module, "_paratrain_recompute", False):
            module.forward = functools.partial(_recomputed, module.forward)  # type: ignore[method-assign]
            module._paratrain_recompute = True  # type: ignore[assignment]
            wrapped.append(name)
    if not wrapped and required:
        raise ValueError(f"recompute pattern {pattern!r} matched no module of {type(model).__name__}")
    return wrapped


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
