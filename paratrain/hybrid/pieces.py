"""What a rank holds, as pieces of the whole model's tensors.

Every layout keeps, on each rank, pieces of the whole model: a parameter whole, a tensor-parallel
slice of it, a range of either inside a ZeRO flat shard, a pipeline stage's tied copy of another
stage's tensor. A Piece names the whole tensor and the slice; a range [lo, hi) of the slice's
flattened elements is then one contiguous run of the rank's storage. Materialising a meta model,
writing a sharded checkpoint and reading one back under another layout all walk these pieces:

    Pieces.piece(local name)      the Piece a local parameter is (tied copies map to their source)
    Pieces.storage(model, groups) where a parameter's values live on this rank: whole parameters,
                                  ZeRO flat buffers or shards, and the float32 masters (all written
                                  when values are loaded or materialised)
    Pieces.owners(model, groups)  the exact values by what the optimizer updates (a parameter, or a
                                  flat group's master): what a checkpoint saves, with the optimizer
                                  state shaped like it
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from paratrain.comm.flat import FlatGroup
from paratrain.state_layout import StateLayout

Shapes = Mapping[str, "tuple[tuple[int, ...], torch.dtype]"]

CHUNK = 1 << 22
"""Elements read or filled per copy (16 MiB of float32)."""


class Values:
    """Anything that gives elements [lo, hi) of a whole tensor's flattened values (a ParamInit)."""

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor: ...


Cut = tuple[int, ...]
"""(dim, index, parts): a slice `index` of `parts` equal slices along `dim`; (dim, index, parts, blocks): the
same slice of each of `blocks` equal blocks of `dim` (a fused tensor's parts, GPT-2's q | k | v, each split alike)."""


@dataclass(frozen=True)
class Piece:
    """Where a local tensor's elements come from: tensor `name` of the whole model (shape `shape`,
    dtype `dtype`), or its slice: slice `index` of `parts` along `dim` for each cut (one per split
    dim: experts over ep along dim 0 and over expert-tp along their hidden dim, say)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: tuple[Cut, ...] | Cut | None = None
    """The cuts, by dim (given as one (dim, index, parts), a tuple of them, or None: the whole tensor)."""

    def __post_init__(self) -> None:
        cuts = () if not self.split else (self.split,) if isinstance(self.split[0], int) else self.split
        if len({c[0] for c in cuts}) != len(cuts):  # type: ignore[index]
            raise ValueError(f"{self.name}: two cuts of one dim {cuts}")
        object.__setattr__(self, "split", tuple(sorted(tuple(c) for c in cuts)))  # type: ignore[arg-type]

    @property
    def cuts(self) -> tuple[Cut, ...]:
        return self.split  # type: ignore[return-value]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        for dim, _, parts, *_ in self.cuts:
            shape[dim] //= parts
        return tuple(shape)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def grid(self) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """The shape and (dim, index, parts) cuts the slice is a plain slice of: a cut of blocks > 1 turns its dim
        into (blocks, size / blocks) and cuts the inner one. The flattened order is the whole tensor's."""
        shape, cuts, shift = list(self.shape), [], 0
        for dim, index, parts, *blocks in self.cuts:
            at = dim + shift
            if blocks and blocks[0] > 1:
                shape[at: at + 1] = [blocks[0], shape[at] // blocks[0]]
                shift, at = shift + 1, at + 1
            cuts.append((at, index, parts))
        return tuple(shape), tuple(cuts)

    def runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Elements [lo, hi) of the flattened slice as (slice element, whole element, length) runs of
        consecutive elements in both."""
        if lo >= hi:
            return []
        if not self.cuts:
            return [(lo, lo, hi - lo)]
        shape, cuts = self.grid
        local = list(shape)
        for dim, _, parts in cuts:
            local[dim] //= parts
        last = cuts[-1][0]
        start = [0] * len(shape)  # where the slice starts along each dim of the whole tensor
        for dim, index, _ in cuts:
            start[dim] = index * local[dim]
        strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]  # of the whole tensor
        local_row = local[last] * strides[last]  # a run: along the last cut dim and everything after it
        runs = []
        for row in range(lo // local_row, -(-hi // local_row)):
            whole, rest = start[last] * strides[last], row
            for dim in range(last - 1, -1, -1):  # the row's coordinates over the dims before `last`
                rest, coord = divmod(rest, local[dim])
                whole += (coord + start[dim]) * strides[dim]
            first, stop = max(lo, row * local_row), min(hi, (row + 1) * local_row)
            runs.append((first, whole + first - row * local_row, stop - first))
        return runs

    def values(self, source: Values, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened slice from `source` (values of the whole tensor), in
        `dtype`, on the CPU; whole rows of the source are read a chunk at a time (several cuts: windows of
        about CHUNK whole elements, each read once)."""
        if not self.cuts:
            return source.values(self.shape, lo, hi).to(self.dtype)
        shape, cuts = self.grid
        if len(cuts) > 1 or len(shape) != len(self.shape):  # runs read a window of about CHUNK whole elements
            parts, window = [], []
            for run in self.runs(lo, hi):
                if window and run[1] + run[2] - window[0][1] > CHUNK:
                    parts += _read_window(source, self.shape, window)
                    window = []
                window.append(run)
            parts += _read_window(source, self.shape, window) if window else []
            return torch.cat(parts).to(self.dtype) if parts else torch.empty(0, dtype=self.dtype)
        (dim, index, parts), = cuts
        outer, size, inner = math.prod(self.shape[:dim]), self.shape[dim], math.prod(self.shape[dim + 1:])
        part = size // parts
        if outer == 1:  # a slice along the first dim that has more than one row: one contiguous range
            offset = index * part * inner
            return source.values(self.shape, lo + offset, hi + offset).to(self.dtype)
        local_row, whole_row = part * inner, size * inner
        step = max(1, CHUNK // whole_row)
        out = []
        first, end = lo // local_row, -(-hi // local_row)
        for start in range(first, end, step):
            stop = min(start + step, end)
            rows = source.values(self.shape, start * whole_row, stop * whole_row).view(stop - start, size, inner)
            local = rows[:, index * part: (index + 1) * part].reshape(-1)
            base = start * local_row
            out.append(local[max(lo - base, 0): hi - base])
        return torch.cat(out).to(self.dtype) if out else torch.empty(0, dtype=self.dtype)


def _read_window(source: Values, shape: Sequence[int], runs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The runs' elements, from one read of the whole elements they span."""
    first, end = runs[0][1], runs[-1][1] + runs[-1][2]
    span = source.values(shape, first, end)
    return [span[whole - first: whole - first + n] for _, whole, n in runs]


@dataclass
class Run:
    """Elements [lo, lo + n) of `piece` are `target[:n]` (a 1-D view of storage this rank keeps)."""

    target: torch.Tensor
    piece: Piece
    lo: int


@dataclass
class Owned:
    """`piece` elements [lo, lo + length) are `owner.view(-1)[offset: offset + length]`; owner is what
    the optimizer keys its state by (a parameter, or a flat group's master)."""

    owner: torch.Tensor
    offset: int
    length: int
    piece: Piece
    lo: int
    local_name: str
    """The parameter's name on this rank (a tied copy's own name, not its source's)."""


@dataclass
class Pieces:
    """How this rank's tensors map to the whole model's (built by parallelize)."""

    whole: Shapes
    """Every stored tensor of the whole model: name -> (shape, dtype), taken before the layout."""
    tied: Mapping[str, str] = field(default_factory=dict)
    """A pipeline stage's copy name -> the name of the tensor it copies."""
    splits: Mapping[str, tuple[Cut, ...]] = field(default_factory=dict)
    """Local parameter name -> its cuts (dim, index, parts): the slice it is of its whole tensor."""

    @classmethod
    def of(cls, whole: Shapes, layouts: Iterable[StateLayout]) -> Pieces:
        """What the layouts applied to a model of `whole` shapes left on this rank (two layouts may cut one
        tensor along two dims: experts over ep and over expert-tp)."""
        tied: dict[str, str] = {}
        splits: dict[str, tuple[Cut, ...]] = {}
        for layout in layouts:
            tied.update(layout.tied)
            for name, cut in layout.splits.items():  # one cut, or several (a 2d grid's block)
                cuts = cut if cut and isinstance(cut[0], tuple) else (cut,)
                splits[name] = (*splits.get(name, ()), *cuts)
        return cls(whole, tied=tied, splits=splits)

    def piece(self, local_name: str) -> Piece:
        name = self.tied.get(local_name, local_name)
        if name not in self.whole:
            raise KeyError(f"{local_name!r} is not a tensor of the model the layout was applied to")
        shape, dtype = self.whole[name]
        return Piece(name, shape, dtype, self.splits.get(local_name, ()))

    def storage(self, model: nn.Module, groups: Sequence[FlatGroup], *, meta_only: bool = False,
                buffers: bool = True) -> list[Run]:
        """Where every value of this rank's parameters (and buffers) lives: flat buffers or shards and
        separate masters of the groups, the tensors themselves otherwise. meta_only: only tensors and
        groups not materialised yet (a whole tensor on the meta device comes back as a Run over the
        meta tensor; the caller allocates). buffers: include buffers (non-persistent ones too)."""
        names = {id(p): n for n, p in model.named_parameters()}
        runs: list[Run] = []
        grouped: set[int] = set()
        for g in groups:
            grouped.update(id(p) for p in g.params)
            if meta_only and g.materialized:
                continue
            targets = [(g.param_flat, 0)] if g.persistent else [(g.shard, g.lo)]
            if g.own_master:
                targets.append((g.master.data, g.lo))
            for param, offset in zip(g.params, g.offsets):
                for target, start in targets:  # this param's elements inside [start, start + len(target))
                    lo, hi = max(offset, start), min(offset + param.numel(), start + target.numel())
                    if lo < hi:
                        runs.append(Run(target[lo - start: hi - start], self.piece(names[id(param)]), lo - offset))
        seen: set[int] = set()
        tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
        for name, tensor in tensors:
            if id(tensor) in grouped or id(tensor) in seen or (meta_only and not tensor.is_meta):
                continue
            seen.add(id(tensor))
            runs.append(Run(tensor if tensor.is_meta else tensor.data.view(-1), self.piece(name), 0))
        return runs

    def owners(self, model: nn.Module, groups: Sequence[FlatGroup]) -> list[Owned]:
        """This rank's exact parameter values by optimizer owner: each flat group's master over its
        shard, every other parameter whole."""
        names = {id(p): n for n, p in model.named_parameters()}
        owned: list[Owned] = []
        grouped: set[int] = set()
        for g in groups:
            for param, offset in zip(g.params, g.offsets):
                grouped.add(id(param))
                lo, hi = max(offset, g.lo), min(offset + param.numel(), g.hi)
                if lo < hi:
                    name = names[id(param)]
                    owned.append(Owned(g.master, lo - g.lo, hi - lo, self.piece(name), lo - offset, name))
        for name, param in model.named_parameters():
            if id(param) not in grouped:
                owned.append(Owned(param, 0, param.numel(), self.piece(name), 0, name))
        return owned


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


def fill(source: Values, runs: Sequence[Run]) -> None:
    """Each run's target from its piece of `source`, CHUNK elements at a time."""
    with torch.no_grad():
        for run in runs:
            for k in range(0, run.target.numel(), CHUNK):
                part = run.target[k: k + CHUNK]
                part.copy_(run.piece.values(source, run.lo + k, run.lo + k + part.numel()))
