"""Tied weights: one parameter registered under several names (a language model's embedding and head).

A tie is found by identity, on any model: the GPT's head, Hugging Face's `tie_word_embeddings` (it
assigns one Parameter to both modules), or a user's modules that share a tensor. Every layout keeps
it: tensor parallelism splits both ends alike or refuses the plan, a pipeline keeps a copy on the
other stage whose gradient is summed with the first end's, checkpoints and exports store it once,
under its first name in the model's state_dict order, and loading restores every alias.
"""

from __future__ import annotations

from torch import nn


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Every group of names under which one parameter is registered, in the model's order (the first
    name is the one checkpoints keep); a model without ties gives []."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]

