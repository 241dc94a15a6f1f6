"""Which parameters share a FlatGroup, in the order their gradients complete in backward.

A flat group holds parameters of one optimizer param group and one Placement (paratrain.comm.
placement): they are reduced, sharded and counted in the norm together, and updated with the same
hyperparameters.
- stages 1-2: size-capped buckets (paratrain.comm.plan_buckets: the parameters in reverse);
- stage 3: one group per (optimizer group, placement) of each unit (gather.py), units in reverse
  and the root (embedding, tied head, final norm) last, so that a unit's groups are contiguous and
  it can be freed as soon as its last one is reduced.
The optimizer is then re-pointed at the groups' masters (this rank's shards), its state emptied
(paratrain.comm.flat.point_optimizer_at).
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from paratrain.comm import plan_buckets
from paratrain.comm.placement import Placement, Placements
from paratrain.comm.flat import FlatGroup, FlatStorage
from paratrain.sharding.gather import Unit, WrapPolicy, units_of


def bucket_groups(params: list[nn.Parameter], group_of: dict[int, int], placements: Placements, *,
                  bucket_bytes: int, storage: FlatStorage) -> list[FlatGroup]:
    """Stages 1-2: flat groups of about bucket_bytes each."""
    planned = plan_buckets(params, cap_bytes=bucket_bytes, key=lambda p: (group_of[id(p)], placements(p)))
    return [FlatGroup(i, ps, shards=placements(ps[0]).shards, shard_index=placements(ps[0]).shard_index,
                      optimizer_group=group_of[id(ps[0])], storage=storage)
            for i, ps in enumerate(planned)]


def unit_groups(params: list[nn.Parameter], group_of: dict[int, int], placements: Placements, *,
                model: nn.Module | None, wrap: WrapPolicy, storage: FlatStorage,
                float8: Mapping[int, object] | None = None) -> tuple[list[FlatGroup], Unit, list[Unit]]:
    """Stage 3: the flat groups of every unit (appended to its Unit.groups), the root unit, and the
    wrapped units in forward order. float8: parameters (by id) gathered in float8, each with the group that also
    splits it; grouped apart, by that group."""
    if model is None:
        raise ValueError("ZeRO-3 needs the model, to gather parameters around its modules")
    root, units, members = units_of(model, params, wrap)
    float8 = float8 or {}
    # Gradients complete in backward order: units reversed, the root (embedding) last.
    groups: list[FlatGroup] = []
    for unit in [*reversed(units), root]:
        by_group: dict[tuple[int, Placement, bool, int], list[nn.Parameter]] = {}
        for param in members[id(unit)]:
            cast = (id(param) in float8, id(float8.get(id(param))))
            by_group.setdefault((group_of[id(param)], placements(param), *cast), []).append(param)
        for (gi, placement, *_), ps in by_group.items():
            unit.groups.append(FlatGroup(len(groups), ps, shards=placement.shards, shard_index=placement.shard_index,
                                         optimizer_group=gi, storage=storage))
            groups.append(unit.groups[-1])
    return groups, root, units
