"""Activation recomputation, applied from outside to modules chosen by name.

A recomputed module keeps only its inputs in forward and recomputes its internals in backward
(torch.utils.checkpoint, non-reentrant). It is wrapped, not changed: a `Recomputed` stands where
it stood in the model and calls its forward under checkpoint. The wrapper adds no level to the
names: it holds the module's own parameters, buffers, children and hooks (the same dicts), so
checkpoints, TP plans and ZeRO-3's units still see `blocks.3.attn.c_attn.weight`; the module itself
is neither mutated nor registered again. Why a wrapper, not a pair of forward hooks that enter and
leave the checkpoint (torch.distributed._composable.checkpoint): torch.compile must see the
checkpoint call inside the compiled block to recompute the compiled graph's own saved tensors; a
checkpoint opened by a hook outside the graph recomputes the eager forward instead, whose saved
tensors differ (a CheckpointError). Every Recomputed shares one forward, so torch.compile captures
one graph for all blocks of a model.

Two modes name modules through the model's recipe (paratrain.nn.recipe; Korthikanti et al. 2022,
section 5):
    full        each block (recipe.blocks): it keeps its input only, and backward runs its forward again
    selective   each block's attention core (recipe.attention_cores: softmax(q k^T) v): the
                activations that grow with the square of the sequence when attention is materialised,
                cheap to recompute
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.recipe import Recipe, recipe_of
from paratrain.nn.wrap import Wrapper

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
                         rf"recipe names none: pass recompute=<a regex of module names> (e.g. r'layers\.\d+'), or a "
                         f"Recipe with {field}=")
    return pattern


class Recomputed(Wrapper):
    """Runs `module`'s forward under non-reentrant checkpointing, in its place in the model.

    Its parameters, buffers, children and hooks are the module's own dicts (paratrain.nn.wrap), so
    names, state dicts and hooks (registered on either) are the module's. The module's own `__call__`
    is not used: its hooks run once, around the checkpoint (outside the recomputation), as for any
    module.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.wrapped
        return checkpoint(module.forward, *args, use_reentrant=False, preserve_rng_state=_draws_random(module),
                          **kwargs)


def apply_recompute(model: nn.Module, pattern: str | None = None, *, required: bool = True) -> list[str]:
    """Recompute every module whose full name matches `pattern` (None: the model's recipe's blocks),
    each wrapped in a Recomputed in its place; returns the names wrapped. required: a pattern that
    matches nothing is an error (a pipeline stage may hold no block).

    The random state is saved and restored around the recomputation (so that torch's own dropout
    redraws the same mask) only where the module draws from torch's generator: a KeyedDropout with
    a stream keys its masks by position and needs no state (saving CUDA's generator state is not
    free)."""
    pattern = recompute_pattern("full", recipe_of(model)) if pattern is None else pattern
    chosen = [(name, module) for name, module in model.named_modules()
              if name and re.fullmatch(pattern, name) and not isinstance(module, Recomputed)]
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, Recomputed(module))
    if not chosen and required:
        raise ValueError(f"recompute pattern {pattern!r} matched no module of {type(model).__name__}")
    return [name for name, _ in chosen]


def recomputed_names(model: nn.Module) -> list[str]:
    """The names of the model's modules that apply_recompute wrapped."""
    return [name for name, module in model.named_modules() if isinstance(module, Recomputed)]


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
