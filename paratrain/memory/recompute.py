"""Activation recomputation, applied from outside to modules chosen by name.

A recomputed module keeps only its inputs in forward and recomputes its internals in backward
(torch.utils.checkpoint, non-reentrant). The module's class is swapped for a subclass whose forward
does that (as torch's own fully_shard swaps classes), rather than wrapping the module in another:
parameter names, and with them checkpoints and TP plans, stay exactly the model's own; and every
recomputed instance of a class shares one forward, so torch.compile captures one graph for all of
them (a per-instance forward would be guarded by identity: a recompilation per block).

Two modes name modules through the model's recipe (paratrain.models.recipe; Korthikanti et al. 2022,
section 5):
    full        each block (recipe.blocks): it keeps its input only, and backward runs its forward again
    selective   each block's attention core (recipe.attention_cores: softmax(q k^T) v): the
                activations that grow with the square of the sequence when attention is materialised,
                cheap to recompute
"""

from __future__ import annotations

import functools
import re
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.nn.dropout import KeyedDropout
from paratrain.models.recipe import Recipe, recipe_of

RECOMPUTE_MODES = ("none", "full", "selective")
"""Named modes; any other string is a regex of module names."""


def recompute_pattern(mode: str, recipe: Recipe) -> str:
    """The regex of module names a mode recomputes: 'full' the recipe's blocks, 'selective' its
    attention cores; any other string is a regex already."""
    field = {"full": "blocks", "selective": "attention_cores"}.get(mode)
    if field is None:
        return mode
    pattern = getattr(recipe, field)
    if pattern is None:
        raise ValueError(f"recompute={mode!r} recomputes the model's {field.replace('_', ' ')}, and this model's "
                         f"recipe names none: pass recompute=<a regex of module names> (e.g. r'layers\.\d+'), or a "
                         f"Recipe with {field}=")
    return pattern


class Recomputed:
    """Marks a module class made by apply_recompute (isinstance(module, Recomputed))."""


def apply_recompute(model: nn.Module, pattern: str | None = None, *, required: bool = True) -> list[str]:
    """Recompute every module whose full name matches `pattern` (None: the model's recipe's blocks);
    returns the names wrapped. required: a pattern that matches nothing is an error (a pipeline stage
    may hold no block).

    The random state is saved and restored around the recomputation (so that torch's own dropout
    redraws the same mask) only where the module draws from torch's generator: a KeyedDropout with
    a stream keys its masks by position and needs no state (saving CUDA's generator state is not
    free)."""
    pattern = recompute_pattern("full", recipe_of(model)) if pattern is None else pattern
    wrapped = []
    for name, module in model.named_modules():
        if name and re.fullmatch(pattern, name) and not isinstance(module, Recomputed):
            module.__class__ = _recomputed_class(type(module))
            wrapped.append(name)
    if not wrapped and required:
        raise ValueError(f"recompute pattern {pattern!r} matched no module of {type(model).__name__}")
    return wrapped


@functools.lru_cache(maxsize=None)
def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(super(recomputed, self).forward, *args, use_reentrant=False,
                          preserve_rng_state=_draws_random(self), **kwargs)

    recomputed = type(f"Recomputed{cls.__name__}", (Recomputed, cls), {"forward": forward, "__module__": cls.__module__})
    return recomputed


def _draws_random(module: nn.Module) -> bool:
    """Whether a module (or one inside it) may draw from torch's generator in training: a dropout
    layer, unless it is a KeyedDropout with a stream (the engine attaches one to each)."""
    for layer in module.modules():
        if isinstance(layer, KeyedDropout):
            if layer.stream is None and layer.p > 0:
                return True
        elif isinstance(layer, nn.modules.dropout._DropoutNd) or "Dropout" in type(layer).__name__:
            return True
    return False
