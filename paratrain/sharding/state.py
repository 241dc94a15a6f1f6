"""ShardedState: ZeRO's model and optimizer state in layout-free form (full tensors by name).

Saving a whole state dict all-gathers each flat group's shards over its shard group and cuts the
full buffer into the parameters. Per-element optimizer state (Adam's moments: tensors shaped like
the master) is converted the same way; anything else (a step counter) is copied to every parameter
of the group. Loading needs no code here: the engine's StateView reads this rank's shard of each
parameter straight from any reader (paratrain.hybrid.view).
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm import all_gather_async
from paratrain.comm.placement import Placement
from paratrain.comm.flat import FlatGroup


class ShardedState:
    def __init__(self, groups: list[FlatGroup], placements: list[Placement], optimizer: torch.optim.Optimizer,
                 names: dict[int, str]) -> None:
        """placements: each group's Placement, by index (its shard group gathers); names: each
        parameter's name, by id."""
        self.groups = groups
        self.placements = placements
        self.optimizer = optimizer
        self.names = names

    # ---- model --------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Every parameter this strategy holds, full, by name, in the masters' precision (the true
        weights when the parameters are stored rounded). Collective over the shard group."""
        state = {}
        for g in self.groups:
            full = self._gather(g.master.detach(), g)
            for param, view in zip(g.params, g.views(full)):
                state[self.names[id(param)]] = view.clone()
        return state

    def _gather(self, shard: torch.Tensor, g: FlatGroup) -> torch.Tensor:
        """[padded] concatenation of every shard-group rank's `shard` (a copy when unsharded)."""
        full = torch.empty(g.padded, dtype=shard.dtype, device=shard.device)
        group = self.placements[g.index].shard
        if group is not None:
            all_gather_async(full, shard.contiguous(), group).wait()
        else:
            full.copy_(shard)
        return full

    # ---- optimizer ----------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state of every parameter, full, by name (collective over the shard group)."""
        state: dict[str, dict[str, Any]] = {}
        for g in self.groups:
            for key, value in self.optimizer.state.get(g.master, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
                    full = self._gather(value, g)
                    for param, view in zip(g.params, g.views(full)):
                        state.setdefault(self.names[id(param)], {})[key] = view.clone()
                else:
                    for param in g.params:
                        copy = value.clone() if isinstance(value, torch.Tensor) else value
                        state.setdefault(self.names[id(param)], {})[key] = copy
        param_groups = []
        for gi, group in enumerate(self.optimizer.param_groups):
            names = [self.names[id(p)] for g in self.groups if g.optimizer_group == gi for p in g.params]
            param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": param_groups}
