"""Dropout whose mask is keyed by the logical position of each element, not by a generator's state.

    y = x * keep / (1 - p),   keep[i] = u(key(seed, step, module name), global index i) >= p

The global index of an element is its position in the tensor a single device would hold for the
whole global batch: dim 0 is the global-batch row (the engine sets the row offset of each
micro-batch), and a dimension that a strategy split evenly across ranks is described by `split`
(dim -> (this rank's index, number of parts)). So tensor parallelism (heads split), sequence
parallelism (sequence split), data parallelism and accumulation all draw the single-device mask;
replicated regions draw the same mask on every rank. Recomputation redraws the same mask.

Without a stream (a model used outside a paratrain engine) it is torch's dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.eager import eager
from paratrain.rng import DropoutStream, hashed_uniform


class KeyedDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.stream: DropoutStream | None = None
        self.key_name = ""
        self.split: dict[int, tuple[int, int]] = {}
        """dim (>= 1) -> (index, parts): this rank holds part `index` of `parts` equal slices of dim."""

    def split_along(self, dim: int, index: int, parts: int) -> None:
        """This rank holds part `index` of `parts` equal slices of `dim` (>= 1) of the input (tensor or
        sequence parallelism): its masks are that slice of the single-device mask."""
        if dim < 1:
            raise ValueError(f"dim 0 (the batch rows) is keyed by DropoutStream.at_rows, not split; got dim {dim}")
        self.split = {**self.split, dim: (index, parts)}

    def attach(self, stream: DropoutStream, name: str) -> None:
        """Draw from `stream` under `name` (the module's name in the model, the same in every layout)."""
        self.stream, self.key_name = stream, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.stream is None:
            return F.dropout(x, self.p, training=True)
        return self._keyed(x)

    @eager  # its key changes every step: compiled, it would be a new graph per step
    def _keyed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.stream is not None
        keep = hashed_uniform(self.stream.key(self.key_name), self._global_index(x)) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def _global_index(self, x: torch.Tensor) -> torch.Tensor:
        """int64 [x.shape]: the row-major index of each element in the logical (unsplit) tensor."""
        assert self.stream is not None
        index = torch.zeros((), dtype=torch.int64, device=x.device)
        for dim, size in enumerate(x.shape):
            part, parts = self.split.get(dim, (0, 1))
            offset, full = part * size, parts * size
            if dim == 0:
                offset = self.stream.row_offset
            coords = torch.arange(offset, offset + size, device=x.device)
            shape = [1] * x.dim()
            shape[dim] = size
            index = index * full + coords.view(shape)
        return index
