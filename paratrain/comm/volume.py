"""Communication volume per rank, counted the way the ZeRO paper counts it (section 7).

An all-reduce of n bytes moves 2n per rank (a reduce-scatter and an all-gather, as ring and
NCCL implementations do); a reduce-scatter whose input is n bytes, or an all-gather whose output is
n bytes, moves n. So plain data parallelism moves 2 psi per step, ZeRO-1/2 2 psi (reduce-scatter
psi + all-gather psi), ZeRO-3 3 psi (all-gather in forward and in backward, reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


@dataclass
class CommVolume:
    bytes: dict[str, int] = field(default_factory=dict)
    """Bytes moved by this rank, by operation, since the last reset()."""

    def add(self, op: str, full: torch.Tensor) -> None:
        """Count one collective whose full-size tensor (all-reduce buffer, reduce-scatter input,
        all-gather output) is `full`."""
        self.bytes[op] = self.bytes.get(op, 0) + _FACTOR[op] * full.numel() * full.element_size()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
