"""Materialise a model built on the meta device: each rank allocates and fills only what it keeps.

parallelize applies the layout to shapes (pipeline stages, tensor-parallel slices, ZeRO flat groups,
all on the meta device) and then calls `materialize`: every tensor this rank keeps is allocated on
its device and filled from the whole model's init by name, piece by piece:

    a whole parameter or buffer       its init's values, all of them
    a tensor-parallel slice           the same slice of the whole tensor (only the blocks it touches
                                      are drawn: KeyedNormal's values are addressable by range)
    a ZeRO flat group                 the elements of its parameters that fall in this rank's shard
                                      (and in the float32 master when it has one), padding zero
    a pipeline stage's tied copy      its first end's tensor (the head's copy of the embedding)

so the model, its shards and slices hold the same bits as a full build sliced afterwards, while no
process ever holds more than its layout keeps (plus one block of the init being drawn).

Where the values come from is a Source, asked once per tensor of the whole model, in name order, on
every rank: `Inits` (the model's keyed init, GPT.param_inits: nothing is communicated) or `FromRank0`
(for a model without one: world rank 0 built it whole and broadcasts one tensor at a time; the other
ranks keep their pieces of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from torch import nn

from paratrain.comm import broadcast
from paratrain.hybrid.pieces import Pieces, Run, fill
from paratrain.models.init import Given, ParamInit
from paratrain.comm.flat import FlatGroup
from paratrain.topology import Mesh

class Source(Protocol):
    def open(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> ParamInit:
        """The init of the whole model's tensor `name`; called on every rank for every tensor, in the
        same order (a source may communicate)."""
        ...


@dataclass(frozen=True)
class Inits:
    """Inits by name (a model's param_inits): each rank draws its own pieces, nothing is sent."""

    inits: Mapping[str, ParamInit]

    def open(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> ParamInit:
        init = self.inits.get(name)
        if init is None:
            raise KeyError(f"no init for {name!r} (of shape {tuple(shape)}): the model's param_inits covers "
                           f"{len(self.inits)} tensors; give every parameter and buffer one, or build the model "
                           "whole on world rank 0 and pass init=FromRank0(model or None, ...)")
        return init


class FromRank0:
    """World rank 0 holds the whole model (built as usual); every other rank built it on the meta
    device and passes None. Each tensor is broadcast from rank 0 along every axis of the mesh in turn
    (after the broadcast along an axis, every rank holds what its index-0 peer along it held, so after
    all of them every rank holds rank 0's tensor): peak memory off rank 0 is one whole tensor."""

    def __init__(self, model: nn.Module | None, mesh: Mesh, device: torch.device) -> None:
        self.tensors = {} if model is None else {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.mesh, self.device = mesh, device

    def open(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> ParamInit:
        own = self.tensors.get(name)
        tensor = (own.detach().to(self.device, dtype) if own is not None
                  else torch.empty(tuple(shape), dtype=dtype, device=self.device))
        if own is not None and tuple(own.shape) != tuple(shape):
            raise ValueError(f"{name}: rank 0's tensor has shape {tuple(own.shape)}, the model {tuple(shape)}")
        for axis in ("pp", "tp", "dp"):
            group = self.mesh.groups.get(axis)
            if group is not None:
                broadcast(tensor, group)
        return Given(tensor)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (shapes only)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def materialize(model: nn.Module, source: Source, pieces: Pieces, *, device: torch.device,
                groups: Sequence[FlatGroup] = ()) -> None:
    """Allocate and fill every meta tensor of `model` (the layout already applied) on `device`.

    pieces: how this rank's tensors map to the whole model's (whole_shapes() of the model before the
    layout, tied copies, tensor-parallel splits). groups: ZeRO flat groups built on meta parameters
    (their storage exists, unfilled). Every rank calls this (a Source may be collective)."""
    plain, by_name = _allocate(pieces.storage(model, groups, meta_only=True), device)
    for name in sorted(pieces.whole):  # the same order on every rank
        shape, dtype = pieces.whole[name]
        fill(source.open(name, shape, dtype), by_name.pop(name, []))
    assert not by_name, f"pieces of no tensor of the whole model: {sorted(by_name)[:4]}"
    for g in groups:
        g.mark_materialized()
    for tensor, new in plain:
        swapped = nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        torch.utils.swap_tensors(tensor, swapped)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after materialising: {left[:6]}")


def _allocate(runs: list[Run], device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                              dict[str, list[Run]]]:
    """Storage for each whole meta tensor (returned as (meta tensor, new storage), swapped into place
    once filled) and the runs to fill, by whole-model name. Its own frame: no view of the new storage
    outlives the fill (a tensor is swapped only when nothing else refers to it)."""
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        if run.target.is_meta:
            new = torch.empty(run.target.shape, dtype=run.target.dtype, device=device)
            plain.append((run.target, new))
            run = Run(new.view(-1), run.piece, run.lo)
        by_name.setdefault(run.piece.name, []).append(run)
    return plain, by_name
