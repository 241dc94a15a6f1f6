"""Layout-free parameter initialisation, drawable piece by piece.

Every logical tensor has an init (ParamInit) that gives the values of any contiguous range of its
flattened elements without computing the others: `values(shape, lo, hi)`. A keyed normal draws its
tensor in blocks of BLOCK elements, block b from its own generator seeded from (seed, name, b), so
the numbers depend neither on how many processes exist, on which rank a parameter lives, on the order
modules were built in, nor on what other code drew random numbers before; and a rank that keeps a
slice of a tensor (a ZeRO-3 shard, a tensor-parallel slice) draws only the blocks that slice touches,
bit-identical to the same slice of the whole tensor (paratrain.hybrid.materialize puts the pieces
together). A model built on the meta device says how to initialise each of its tensors by name
(GPT.param_inits) and never holds more than its rank keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from paratrain.rng import keyed_generator

BLOCK = 1 << 20
"""Elements drawn from one generator (4 MiB in float32): the granularity of a partial draw."""


class ParamInit(Protocol):
    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened tensor of `shape`, 1-D, on the CPU."""
        ...


@dataclass(frozen=True)
class KeyedNormal:
    """N(0, std^2) in float32, block b of the flattened tensor drawn from the (seed, key, b) generator
    (block 0 from (seed, key): a tensor of one block keeps the values of a single draw)."""

    seed: int
    key: str
    std: float

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        numel = math.prod(shape)
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"{self.key}: range [{lo}, {hi}) outside a tensor of {numel} elements")
        parts = []
        for block in range(lo // BLOCK, -(-hi // BLOCK)):
            start = block * BLOCK
            drawn = torch.empty(min(BLOCK, numel - start), dtype=torch.float32)
            suffix = f"/{block}" if block else ""
            drawn.normal_(0.0, self.std, generator=keyed_generator(self.seed, f"param/{self.key}{suffix}"))
            parts.append(drawn[max(lo - start, 0): hi - start])
        return torch.cat(parts) if len(parts) != 1 else parts[0]


@dataclass(frozen=True)
class Constant:
    """Every element `value` (norm weights 1, biases 0)."""

    value: float

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        return torch.full((hi - lo,), self.value, dtype=torch.float32)


@dataclass(frozen=True)
class Given:
    """Values already computed (a buffer such as RoPE's tables, or a tensor received from another rank)."""

    tensor: torch.Tensor

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        if tuple(shape) != tuple(self.tensor.shape):
            raise ValueError(f"given tensor of shape {tuple(self.tensor.shape)} for a tensor of shape {tuple(shape)}")
        return self.tensor.detach().reshape(-1)[lo:hi].cpu()


@torch.no_grad()
def init_tensor_(tensor: torch.Tensor, init: ParamInit) -> torch.Tensor:
    """Fill the whole `tensor` from `init` (cast to its dtype, copied to its device)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else None
    values = init.values(tensor.shape, 0, tensor.numel())
    if flat is not None:
        flat.copy_(values)
    else:
        tensor.copy_(values.view(tensor.shape))
    return tensor


@torch.no_grad()
def keyed_normal_(tensor: torch.Tensor, *, seed: int, name: str, std: float) -> torch.Tensor:
    """Fill `tensor` with KeyedNormal(seed, name, std): N(0, std^2) keyed by (seed, name)."""
    return init_tensor_(tensor, KeyedNormal(seed, name, std))
