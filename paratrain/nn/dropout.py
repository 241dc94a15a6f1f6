"""Dropout whose mask is keyed by the logical position of each element, not by a generator's state.

    y = x * keep / (1 - p),   keep[i] = u(key(seed, step, module name), global index i) >= p

The global index of an element is its position in the tensor a single device would hold for the
whole global batch: dim 0 is the global-batch row (the engine sets the row offset of each
micro-batch), and a dimension a strategy split across ranks says how its local coordinates map to
the whole tensor's (`split_along`: an even slice; `place_along`: the sequence positions context
parallelism gives this rank). So tensor parallelism (heads split), sequence parallelism (sequence
split), context parallelism (balanced sequence chunks), data parallelism and accumulation all draw
the single-device mask; replicated regions draw the same mask on every rank. Recomputation redraws the
same mask.

Without a stream (a model used outside a paratrain engine) it is torch's dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.eager import eager
from paratrain.rng import DropoutStream, hashed_uniform


@dataclass(frozen=True)
class EvenSplit:
    """This rank holds slice `index` of `parts` equal slices of a dim."""

    index: int
    parts: int

    def widen(self, coords: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
        """Coordinates in this rank's slice (of `size`) -> coordinates in the unsplit dim, and its size."""
        return coords + self.index * size, size * self.parts


@dataclass(frozen=True)
class Placed:
    """This rank's entries of a dim sit at `positions(size, device)` of a dim `parts` times as long
    (context parallelism's sequence positions)."""

    positions: Callable[[int, torch.device], torch.Tensor]
    parts: int

    def widen(self, coords: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
        return self.positions(size, coords.device)[coords], size * self.parts


DimSplit = EvenSplit | Placed


class KeyedDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.stream: DropoutStream | None = None
        self.key_name = ""
        self.split: dict[int, tuple[DimSplit, ...]] = {}
        """dim (>= 1) -> how a local coordinate becomes the whole tensor's, innermost first: a split
        registered later is of a longer dim (tensor parallelism splits what context parallelism left
        this rank, so its split comes first)."""

    def split_along(self, dim: int, index: int, parts: int) -> None:
        """This rank holds part `index` of `parts` equal slices of `dim` of the input (tensor or sequence
        parallelism; dim 0: the 2d grid's block of the micro-batch's rows): its masks are that slice of the
        single-device mask."""
        self._add(dim, EvenSplit(index, parts))

    def place_along(self, dim: int, positions: Callable[[int, torch.device], torch.Tensor], parts: int) -> None:
        """This rank's entries of `dim` (>= 1) sit at positions(size, device) of a dim `parts` times as
        long (context parallelism: a rank's sequence positions, paratrain.nn.sequence.SequenceSplit)."""
        self._add(dim, Placed(positions, parts))

    def _add(self, dim: int, split: DimSplit) -> None:
        if dim < 0 or (dim == 0 and not isinstance(split, EvenSplit)):
            raise ValueError(f"dim {dim}: a split is of a dim >= 1, or an even split of dim 0 (the micro-batch's rows "
                             "cut over the 2d grid's rows; DropoutStream.at_rows keys where the micro-batch starts)")
        self.split = {**self.split, dim: (*self.split.get(dim, ()), split)}

    @property
    def reads_fixed_split(self) -> str:
        """Why this module cannot follow a split that changes by micro-batch (its masks drawn at the fixed split's
        positions of a sequence); "" when it can (no dropout, or none placed along a sequence)."""
        placed = any(isinstance(split, Placed) for splits in self.split.values() for split in splits)
        return f"dropout {self.p:g} draws its masks at the fixed split's positions" if placed and self.p > 0 else ""

    def attach(self, stream: DropoutStream, name: str) -> None:
        """Draw from `stream` under `name` (the module's name in the model, the same in every layout)."""
        self.stream, self.key_name = stream, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.stream is None:
            return F.dropout(x, self.p, training=True)
        return self._keyed(x, {})

    def at(self, x: torch.Tensor, coords: Mapping[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
        """Dropout of x, a block of the tensor this module drops, whose dims in `coords` hold the entries
        coords[dim] = (int64 coordinates [x.shape[dim]], the dim's size) of the tensor this module would
        be given (the registered splits still widen them): e.g. a block of attention probabilities
        [B, H, Sq, Sk] at some query and key positions (ring attention)."""
        if not self.training or self.p == 0.0:
            return x
        if self.stream is None:
            raise ValueError("KeyedDropout.at draws a block of a keyed mask: attach a DropoutStream first "
                             "(an engine does), or use the module on the whole tensor")
        return self._keyed(x, coords)

    @eager  # its key changes every step: compiled, it would be a new graph per step
    def _keyed(self, x: torch.Tensor, coords: Mapping[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
        assert self.stream is not None
        keep = hashed_uniform(self.stream.key(self.key_name), self._global_index(x, coords)) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def _global_index(self, x: torch.Tensor, given: Mapping[int, tuple[torch.Tensor, int]]) -> torch.Tensor:
        """int64 [x.shape]: the row-major index of each element in the logical (unsplit) tensor."""
        assert self.stream is not None
        index = torch.zeros((), dtype=torch.int64, device=x.device)
        for dim, size in enumerate(x.shape):
            if dim == 0:  # the global-batch rows: a split of them widens from the micro-batch's first row
                coords, full = torch.arange(size, device=x.device), size
                for split in self.split.get(0, ()):
                    coords, full = split.widen(coords, full)
                coords = coords + self.stream.row_offset
            else:
                coords, full = given[dim] if dim in given else (torch.arange(size, device=x.device), size)
                for split in self.split.get(dim, ()):
                    coords, full = split.widen(coords.to(x.device), full)
            shape = [1] * x.dim()
            shape[dim] = size
            index = index * full + coords.view(shape)
        return index
