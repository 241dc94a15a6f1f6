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

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from torch import nn

from paratrain.comm import broadcast
from paratrain.models.init import Given, ParamInit
from paratrain.sharding.flat import FlatGroup
from paratrain.topology import Mesh

CHUNK = 1 << 22
"""Elements filled per copy: what a fill holds besides its target (16 MiB of float32)."""


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


@dataclass(frozen=True)
class Piece:
    """Where a local tensor's elements come from: tensor `name` of the whole model (shape `shape`,
    dtype `dtype`), or its slice `index` of `parts` along dim `dim`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: tuple[int, int, int] | None = None
    """(dim, index, parts), or None for the whole tensor."""

    def values(self, init: ParamInit, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened local tensor, in `dtype`, on the CPU."""
        if self.split is None:
            return init.values(self.shape, lo, hi).to(self.dtype)
        dim, index, parts = self.split
        outer, size, inner = math.prod(self.shape[:dim]), self.shape[dim], math.prod(self.shape[dim + 1:])
        part = size // parts
        if outer == 1:  # a slice along the first dim that has more than one row: one contiguous range
            offset = index * part * inner
            return init.values(self.shape, lo + offset, hi + offset).to(self.dtype)
        local_row, full_row = part * inner, size * inner
        step = max(1, CHUNK // full_row)  # whole rows of the full tensor drawn at a time
        pieces = []
        first, end = lo // local_row, -(-hi // local_row)
        for start in range(first, end, step):
            stop = min(start + step, end)
            rows = init.values(self.shape, start * full_row, stop * full_row).view(stop - start, size, inner)
            local = rows[:, index * part: (index + 1) * part].reshape(-1)
            base = start * local_row
            pieces.append(local[max(lo - base, 0): hi - base])
        return torch.cat(pieces).to(self.dtype) if pieces else torch.empty(0, dtype=self.dtype)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (shapes only)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def whole_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every stored tensor of the whole model (parameters once, buffers), by name: what a Source is
    asked for, taken before the layout is applied."""
    seen: set[int] = set()
    shapes = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            shapes[name] = (tuple(tensor.shape), tensor.dtype)
    return shapes


@dataclass
class _Write:
    target: torch.Tensor
    """1-D, a region of the storage this rank keeps."""
    piece: Piece
    lo: int
    """Local element of the piece that lands at target[0]."""


@torch.no_grad()
def materialize(model: nn.Module, source: Source, whole: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                device: torch.device, groups: Sequence[FlatGroup] = (), tied: Mapping[str, str] | None = None,
                split_dims: Mapping[str, int] | None = None, tp_index: int = 0, tp_parts: int = 1) -> None:
    """Allocate and fill every meta tensor of `model` (the layout already applied) on `device`.

    whole: whole_shapes() of the model before the layout. groups: ZeRO flat groups built on meta
    parameters (their storage exists, unfilled). tied: a pipeline stage's copy name -> the name it
    copies. split_dims: tensor-parallel parameter name -> split dim, over tp_parts ranks, this one
    tp_index. Every rank calls this (a Source may be collective)."""
    tied, split_dims = tied or {}, split_dims or {}
    names = {id(p): n for n, p in model.named_parameters()}

    def piece(local_name: str) -> Piece:
        name = tied.get(local_name, local_name)
        if name not in whole:
            raise KeyError(f"{local_name!r} is not a tensor of the model the layout was applied to")
        shape, dtype = whole[name]
        dim = split_dims.get(local_name)
        return Piece(name, shape, dtype, None if dim is None else (dim, tp_index, tp_parts))

    writes: dict[str, list[_Write]] = {}

    def add(target: torch.Tensor, p: Piece, lo: int) -> None:
        if target.numel():
            writes.setdefault(p.name, []).append(_Write(target, p, lo))

    in_groups = set()
    for g in groups:
        if g.materialized:
            continue
        targets = [(g.param_flat, 0)] if g.persistent else [(g.shard, g.lo)]
        if g.own_master:
            targets.append((g.master.data, g.lo))
        for param, offset in zip(g.params, g.offsets):
            in_groups.add(id(param))
            for target, start in targets:  # this param's elements inside [start, start + len(target))
                lo, hi = max(offset, start), min(offset + param.numel(), start + target.numel())
                if lo < hi:
                    add(target[lo - start: hi - start], piece(names[id(param)]), lo - offset)
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []  # (meta tensor, its new storage)
    seen: set[int] = set()
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_meta and id(tensor) not in in_groups and id(tensor) not in seen:
            seen.add(id(tensor))
            new = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            plain.append((tensor, new))
            add(new.view(-1), piece(name), 0)
    for name in sorted(whole):  # the same order on every rank
        shape, dtype = whole[name]
        _fill(source.open(name, shape, dtype), writes.pop(name, []))
    assert not writes, f"pieces of no tensor of the whole model: {sorted(writes)[:4]}"
    for g in groups:
        g.materialized = True
    for tensor, new in plain:
        swapped = nn.Parameter(new, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        torch.utils.swap_tensors(tensor, swapped)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device after materialising: {left[:6]}")


def _fill(init: ParamInit, writes: list[_Write]) -> None:
    """Each write's target from its piece of `init`, CHUNK elements at a time (the views it takes die
    here: a tensor is swapped into place only when nothing else refers to it)."""
    for write in writes:
        for k in range(0, write.target.numel(), CHUNK):
            part = write.target[k: k + CHUNK]
            part.copy_(write.piece.values(init, write.lo + k, write.lo + k + part.numel()))
