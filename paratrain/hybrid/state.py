"""Layout-free state: model tensors and optimizer state keyed by parameter *name*.

torch's optimizer.state_dict() keys state by the parameter's position in the optimizer, which
changes with how parameters are grouped, sharded or split into stages. Keyed by the model's
parameter names instead, the same state loads into any layout.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn


def model_state(model: nn.Module, *, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers, each stored tensor once (a tied weight under its first name).
    skip: names another holder (a sharding strategy) provides."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            if name not in skip:
                state[name] = tensor.detach()
    return state


@torch.no_grad()
def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor], *,
                     skip: frozenset[str] = frozenset()) -> None:
    """Copy `state` into the model in place; every stored tensor must be given, with its shape.
    skip: names another holder (a sharding strategy) loads; they must still be in `state`."""
    own = model_state(model, skip=skip)
    missing = sorted((set(own) | skip) - set(state))
    unexpected = sorted(set(state) - set(own) - skip)
    if missing or unexpected:
        raise KeyError(f"model state does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in own.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: saved shape {tuple(state[name].shape)} != model shape {tuple(tensor.shape)}")
        tensor.copy_(state[name])


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """optimizer.state_dict() with each parameter index replaced by the parameter's name."""
    raw = optimizer.state_dict()
    index_to_name = {}
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            index_to_name[index] = names[id(param)]
            index += 1
    groups = []
    for group in raw["param_groups"]:
        groups.append({**group, "params": [index_to_name[i] for i in group["params"]]})
    state = {index_to_name[i]: dict(values) for i, values in raw["state"].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer, named: Mapping[str, Any], *, names: dict[int, str]) -> None:
    """Inverse of optimizer_state: map names back to this optimizer's parameters.

    torch's load_state_dict pairs saved and current parameters by position within each group, so
    the groups are rebuilt in this optimizer's order; the saved order (another layout's) is free.
    """
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer has {len(saved_groups)} param groups, this one {len(optimizer.param_groups)}")
    name_to_index: dict[str, int] = {}
    groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group_names = [names[id(p)] for p in group["params"]]
        if sorted(group_names) != sorted(saved["params"]):
            raise KeyError("optimizer state does not match the model's parameters: a saved param group "
                           f"holds {len(saved['params'])} names, this one {len(group_names)} (or other names)")
        indices = []
        for name in group_names:
            name_to_index[name] = len(name_to_index)
            indices.append(name_to_index[name])
        groups.append({**copy.deepcopy({k: v for k, v in saved.items() if k != "params"}), "params": indices})
    # torch keeps the given tensors when dtype and device already match: copy them, or the caller's
    # dict would be trained in place (and a second load from it would start from moved state)
    state = {name_to_index[n]: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                for k, v in values.items()}
             for n, values in named["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
