"""Layout-free state: model tensors and optimizer state keyed by parameter *name*.

torch's optimizer.state_dict() keys state by the parameter's position in the optimizer, which
changes with how parameters are grouped, sharded or split into stages. Keyed by the model's
parameter names instead, the same state loads into any layout.
"""

from __future__ import annotations

from typing import Any

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
