"""Where each parameter's gradient lives on the mesh: the data a gradient strategy works from.

A gradient strategy (GradSync, ZeroSync) needs four facts about each parameter, and nothing else
about the layout:

- `reduce`: the ranks holding replicas of it, over which its gradient is summed (dp; for an expert
  under expert parallelism, edp: the dp ranks holding the same experts);
- `shard`, `replicate`: the ranks ZeRO splits its flat group over, and the ranks holding the same
  shard when that split is smaller than `reduce` (MiCS / HSDP);
- `split`: the ranks holding *different* pieces of it, so the squares of the gradient norm add up
  over them (tp for a tensor-parallel slice, ep for experts, pp for every pipeline stage);
- `tied`, `counted`: a weight tied across pipeline stages is summed over the `tied` group after the
  reduction, and only one of its ends counts in the norm.

Strategies that lay the model out give their parameters a Placement (tp splits, ep slices, pp ties);
parameters of different placements never share a bucket or flat group, so each bucket has one.
A new axis (context parallelism, say) is a new Placement: the strategies need no new case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

from paratrain.comm.norms import NormPart
from paratrain.topology.mesh import AxisGroup, Mesh


@dataclass(frozen=True)
class Placement:
    reduce: AxisGroup | None = None
    """The ranks holding a replica: its gradient is summed over them (None: no other rank holds one)."""
    shard: AxisGroup | None = None
    """ZeRO: the ranks its flat group is split over (None: unsplit)."""
    replicate: AxisGroup | None = None
    """ZeRO with a split smaller than `reduce`: the ranks holding the same shard."""
    split: tuple[AxisGroup, ...] = ()
    """The ranks holding different pieces of it: its gradient norm's squares add up over them."""
    tied: AxisGroup | None = None
    """Summed over this group after the reduction (the other end of a weight tied across stages)."""
    counted: bool = True
    """False: another rank counts it in the gradient norm."""
    copies: tuple[AxisGroup, ...] | None = None
    """The tensor-parallel groups whose other ranks hold the same value (a 2d grid's bias down its column, a 2.5d
    grid's blocks over depth): its gradient is summed inside the layer, and only their first rank writes it.
    None: tensor parallelism's copies are the whole tp group's, unless `split` names it."""
    served: bool = False
    """Held with its optimizer state by dedicated parameter servers (paratrain.param_server): they write it
    to checkpoints and load its optimizer state; a trainer's copy is only a copy."""

    @classmethod
    def data_parallel(cls, mesh: Mesh) -> Placement:
        """A parameter replicated over dp (and cp; sharded over dp_shard under ZeRO), on one pipeline stage. Under
        DiLoCo over its replica group only (the groups meet at outer steps, not in the gradient strategy)."""
        pp = mesh.groups.get("pp")
        local = mesh.dims.dp_local
        return cls(reduce=mesh.data_group(), shard=mesh.data_group() if local else mesh.groups.get("dp_shard"),
                   replicate=None if local else mesh.groups.get("dp_replicate"), split=(pp,) if pp is not None else ())

    def split_over(self, group: AxisGroup) -> Placement:
        """The same, and other ranks of `group` hold other pieces of it."""
        return dataclasses.replace(self, split=(group, *self.split))

    def norm_axes(self, *, sharded: bool) -> tuple[AxisGroup, ...]:
        """The axes its norm's squares add up over; sharded: the strategy holds only its shard."""
        return ((self.shard,) if sharded and self.shard is not None else ()) + self.split

    def writes(self, tp: AxisGroup | None, *, sharded: bool) -> bool:
        """Whether this rank writes its value of a tensor so placed to a checkpoint: the first of the
        ranks that hold the same value (the reduce group's replicas, or under ZeRO the replicate group's
        copies of one shard; and the tensor-parallel ranks of a tensor tp does not split). sharded: this
        rank holds the tensor as a ZeRO shard."""
        if self.served:
            return False
        copies = self.replicate if sharded else self.reduce
        if copies is not None and copies.index != 0:
            return False
        if self.copies is not None:  # the tensor-parallel copies are these, not the whole tp group
            return all(group.index == 0 for group in self.copies)
        return tp is None or tp.index == 0 or any(group is tp for group in self.split)

    @property
    def shards(self) -> int:
        return self.shard.size if self.shard is not None else 1

    @property
    def shard_index(self) -> int:
        return self.shard.index if self.shard is not None else 0


class Placements:
    """Each parameter's Placement (by id(), `default` for the others), and every kind of placement the
    layout has, in one order on every rank, whether this rank holds parameters of it or not."""

    def __init__(self, default: Placement = Placement(),
                 kinds: Iterable[tuple[Placement, Iterable[int]]] = ()) -> None:
        """kinds: (placement, ids of the parameters placed so), one per strategy that places some."""
        self.default = default
        self._of: dict[int, Placement] = {}
        self.kinds: list[Placement] = [default]
        for placement, ids in kinds:
            self.add(placement, ids)

    def add(self, placement: Placement, ids: Iterable[int]) -> None:
        """A kind of placement a strategy gives the parameters `ids` (id() of each)."""
        self.kinds.append(placement)
        self._of.update(dict.fromkeys(ids, placement))

    def __call__(self, param: torch.Tensor) -> Placement:
        return self._of.get(id(param), self.default)

    def tie(self, param: torch.Tensor, group: AxisGroup | None, *, counted: bool) -> None:
        """`param` is one end of a weight tied across stages over `group`; counted: this end is the one
        the gradient norm counts. The tied placement's norm axes are its untied one's."""
        placed = self(param)  # a copy another layout already leaves to another rank (2.5d's depth) stays uncounted
        self._of[id(param)] = dataclasses.replace(placed, tied=group, counted=counted and placed.counted)

    def norm_parts(self, grads: Iterable[tuple[torch.Tensor, torch.Tensor]], *, sharded: bool) -> list[NormPart]:
        """The gradient norm's parts from (a parameter, the gradient buffer holding it) of each bucket or
        flat group; sharded: the buffers are ZeRO shards. Every kind's part is there, in one order on
        every rank, holding gradients of it or not: a pipeline stage with only the embedding, or only
        the final norm and a skipped tied head, issues the same collectives as the others."""
        parts: dict[tuple[AxisGroup, ...], list[torch.Tensor]] = {
            k.norm_axes(sharded=sharded): [] for k in self.kinds}
        for param, grad in grads:
            placement = self(param)
            if placement.counted:
                parts.setdefault(placement.norm_axes(sharded=sharded), []).append(grad)
        return [NormPart(buffers, axes) for axes, buffers in parts.items()]
