"""ZeRO-3 parameter gathering: full parameters exist only around the unit that uses them.

A unit is one wrapped module (by default each of the model recipe's blocks: one transformer block)
and the FlatGroups of its parameters; the root unit holds what no wrapped module owns (for a
language model: the embedding, tied to the head, and the final norm). Hooks on each unit:

    forward pre-hook    gather this unit (wait), start gathering the next unit (prefetch)
    forward hook        free this unit (unless reshard_after_forward is False)
    backward pre-hook   gather this unit again (wait), start gathering the unit before it
    (the gradient reducer calls reduced(): a unit is freed once every gradient of it is launched)

The root unit is gathered when the model's forward starts and freed after backward (or right after
forward, in evaluation). Prefetching follows forward order, then its reverse in backward, which is
the order the units were registered in for a model that registers its blocks in the order it runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, Union

import torch
from torch import nn

from paratrain.comm import all_gather_async
from paratrain.comm.flat import FlatGroup
from paratrain.sharding.float8_gather import Float8Gather
from paratrain.topology import AxisGroup


class InFlight(Protocol):
    def wait(self) -> None: ...


@dataclass
class Unit:
    name: str
    """Module name ("" for the root unit)."""
    module: nn.Module
    groups: list[FlatGroup] = field(default_factory=list)
    state: str = "free"
    """'free', 'gathering' (all-gather in flight) or 'ready'."""
    pending: list[InFlight] = field(default_factory=list)
    """Gathers in flight: all-gathers (Pending), or float8 ones that read their values back on wait()."""


WrapPolicy = Union[str, type, tuple[type, ...], None]
"""ZeRO-3 units: a regex of module names, module class(es), or None (no unit but the root: the whole model)."""


def units_of(model: nn.Module, params: list[nn.Parameter],
             wrap: WrapPolicy) -> tuple[Unit, list[Unit], dict[int, list[nn.Parameter]]]:
    """The root unit, the wrapped units in forward (registration) order, and each unit's trainable
    parameters (keyed by id(unit)). A parameter belongs to a wrapped unit when every module that
    owns it lies inside that unit; a weight shared across units (tied) goes to the root."""
    units: list[Unit] = []
    for name, module in model.named_modules():
        if wrap is None or not name or any(name.startswith(u.name + ".") for u in units):
            continue  # the outermost match wins
        if re.fullmatch(wrap, name) if isinstance(wrap, str) else isinstance(module, wrap):
            units.append(Unit(name, module))
    root = Unit("", model)
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)

    def unit_of(param: nn.Parameter) -> Unit:
        for unit in units:
            if all(o == unit.name or o.startswith(unit.name + ".") for o in owners[id(param)]):
                return unit
        return root

    members: dict[int, list[nn.Parameter]] = {id(u): [] for u in [root, *units]}
    for param in params:
        members[id(unit_of(param))].append(param)
    return root, units, members


class ParamGatherer:
    def __init__(self, root: Unit, units: list[Unit], shard_groups: Sequence[AxisGroup | None], *,
                 reshard_after_forward: bool, float8: Mapping[int, Float8Gather] | None = None) -> None:
        """shard_groups: by FlatGroup index, the group each flat group's shards are spread over (None:
        unsharded); a unit may hold groups of different ones (a MoE block: experts over edp, the rest
        over dp). float8: by FlatGroup index, the groups gathered in float8 (paratrain.sharding.float8_gather)."""
        self.float8 = dict(float8 or {})
        self.root = root
        self.units = units
        """Wrapped units in forward order."""
        self.shard_groups = shard_groups
        self.reshard_after_forward = reshard_after_forward
        self._unit_of = {g.index: u for u in [root, *units] for g in u.groups}
        """The unit holding each flat group, by FlatGroup index."""
        self._hooks: list[Any] = []
        for position, unit in enumerate(units):
            self._hooks += [
                unit.module.register_forward_pre_hook(lambda m, a, p=position: self._pre_forward(p)),
                unit.module.register_forward_hook(lambda m, a, o, p=position: self._post_forward(p)),
                unit.module.register_full_backward_pre_hook(lambda m, g, p=position: self._pre_backward(p)),
            ]
        self._hooks += [
            root.module.register_forward_pre_hook(lambda m, a: self.gather(self.root)),
            root.module.register_forward_hook(lambda m, a, o: self._root_post_forward()),
        ]

    def close(self) -> None:
        """Remove the forward and backward hooks (the units gather no more)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def gather(self, unit: Unit, *, wait: bool = True) -> None:
        if unit.state == "free":
            for group in unit.groups:
                group.allocate()
                shard_group = self.shard_groups[group.index]
                if group.index in self.float8:
                    unit.pending.append(self.float8[group.index].start())
                elif shard_group is not None:
                    unit.pending.append(all_gather_async(group.param_flat, group.shard, shard_group))
                else:
                    group.shard_of(group.param_flat).copy_(group.shard)
            unit.state = "gathering"
        if wait and unit.state == "gathering":
            for pending in unit.pending:
                pending.wait()
            unit.pending.clear()
            unit.state = "ready"

    def free(self, unit: Unit) -> None:
        if unit.state == "gathering":  # never free memory a collective is still writing into
            self.gather(unit, wait=True)
        for group in unit.groups:
            group.free()
        unit.state = "free"

    def reduced(self, index: int) -> None:
        """The reduction of flat group `index` is launched, and those of every group before it (the
        reducer launches in group order): free its unit when that was the unit's last group."""
        unit = self._unit_of[index]
        if all(g.index <= index for g in unit.groups):
            self.free(unit)

    def free_all(self) -> None:
        for unit in [*self.units, self.root]:
            self.free(unit)

    def _pre_forward(self, position: int) -> None:
        self.gather(self.units[position])
        if position + 1 < len(self.units):
            self.gather(self.units[position + 1], wait=False)

    def _post_forward(self, position: int) -> None:
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.free(self.units[position])

    def _pre_backward(self, position: int) -> None:
        self.gather(self.units[position])
        if position > 0:
            self.gather(self.units[position - 1], wait=False)

    def _root_post_forward(self) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will come to free it
            self.free_all()
