"""Element positions of a flat buffer as spans (paratrain.optim.exchange's messages): a few integers per contiguous
stretch, expanded into an index only for the copy that uses them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Span = tuple[int, int]
"""(first position, count)."""
FEW_SPANS = 64
"""Positions in at most this many spans are copied span by span (slices), more by an expanded index."""


@dataclass(frozen=True)
class Positions:
    """Element positions kept as spans (a few integers per contiguous stretch, not 8 bytes per element), expanded
    into an index for the step that uses them."""

    starts: torch.Tensor
    counts: torch.Tensor
    total: int
    spans: tuple[Span, ...] | None
    """The spans, when at most FEW_SPANS (None: more)."""

    @classmethod
    def of(cls, spans: Sequence[Span], device: torch.device) -> Positions:
        merged: list[list[int]] = []
        for start, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += n
            elif n:
                merged.append([start, n])
        starts = torch.tensor([m[0] for m in merged], dtype=torch.long, device=device)
        counts = torch.tensor([m[1] for m in merged], dtype=torch.long, device=device)
        return cls(starts, counts, int(counts.sum()) if merged else 0,
                   tuple((a, n) for a, n in merged) if len(merged) <= FEW_SPANS else None)

    def __len__(self) -> int:
        return self.total

    def take(self, source: torch.Tensor) -> torch.Tensor:
        """source's elements at these positions, in order (copied span by span when there are few spans)."""
        if self.spans is not None:
            return torch.cat([source[a: a + n] for a, n in self.spans]) if self.spans else source.new_empty(0)
        return source[self.index()]

    def put(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """target at these positions = values, in order."""
        if self.spans is not None:
            at = 0
            for a, n in self.spans:
                target[a: a + n] = values[at: at + n]
                at += n
        else:
            target[self.index()] = values

    def index(self) -> torch.Tensor:
        if not self.total:
            return self.starts.new_empty(0)
        shift = self.starts - (torch.cumsum(self.counts, 0) - self.counts)
        # output_size: without it repeat_interleave reads the counts' sum back from the device (a host sync a step)
        return torch.arange(self.total, device=self.starts.device) + torch.repeat_interleave(shift, self.counts,
                                                                                             output_size=self.total)
