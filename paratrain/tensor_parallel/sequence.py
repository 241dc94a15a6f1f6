"""SequenceChunks: what a tp rank holds of each sequence under sequence parallelism, for MoE routing.

Under sequence parallelism (Korthikanti et al. 2022) the tokens between the tensor-parallel layers are
split over tp along the sequence: rank j of tp holds the j-th of tp contiguous chunks of what it would
hold otherwise (the whole sequence, or its context-parallel part). A MoE layer sits there: each tp rank
routes its own tokens (no gather of the hidden states; the experts run on 1/tp of the tokens each), and
keeps the single process's per-sequence rules through this paratrain.nn.sequence.SequenceSplit:

    positions(n)   the chunk's positions in the whole sequence (inside the cp part's, under cp)
    gather(x, d)   the whole sequence of a small tensor in position order: capacity counts each expert's
                   assignments over the sequence (all-gather over tp, then over cp)
    sum(x)         a sum over the ranks of one sequence: the balancing loss's routed fractions

Attention does not run on the split sequence (the tensor-parallel linear layers gather it first), so
attend and attention_core refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm import all_reduce
from paratrain.comm.regions import all_gather_along
from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.moe import MoE
from paratrain.nn.sequence import SequenceSplit
from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class SequenceChunks:
    group: AxisGroup
    """The tp ranks; rank j holds chunk j of tp contiguous chunks."""
    outer: SequenceSplit | None = None
    """What the rank's part is of the whole sequence before the tp split (context parallelism), or None."""

    @property
    def parts(self) -> int:
        return self.group.size * (self.outer.parts if self.outer is not None else 1)

    def within(self, outer: SequenceSplit) -> SequenceChunks:
        """The same chunks of the part `outer` (context parallelism) leaves this rank."""
        if self.outer is not None:
            raise ValueError("a sequence-parallel split already sits inside another split")
        return SequenceChunks(self.group, outer)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        start = self.group.index * local_len
        if self.outer is None:
            return torch.arange(start, start + local_len, device=device)
        return self.outer.positions(local_len * self.group.size, device)[start: start + local_len]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        whole = all_gather_along(x.detach().contiguous(), self.group, dim)  # the tp chunks, in order
        return whole if self.outer is None else self.outer.gather(whole, dim)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        all_reduce(total, self.group)
        return total if self.outer is None else self.outer.sum(total)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        raise NotImplementedError(_NO_ATTENTION)

    def attention_core(self, dropout: nn.Module | None = None) -> nn.Module:
        raise NotImplementedError(_NO_ATTENTION)


_NO_ATTENTION = ("sequence parallelism splits the tokens between the tensor-parallel layers only; attention runs "
                 "on the gathered sequence (context parallelism splits it for attention)")


def route_sequence_chunks(model: nn.Module, group: AxisGroup) -> list[str]:
    """Sequence parallelism over `group`: every MoE layer of `model` routes this tp rank's chunk of each
    sequence (SequenceChunks), and its shared expert's dropout, which runs on the chunk, draws the mask there.
    Returns the layers' names. Call it before context parallelism splits the sequence (its split is outer)."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            module.split_sequence(SequenceChunks(group))
            dropout = getattr(module.shared, "dropout", None)
            if isinstance(dropout, KeyedDropout):
                dropout.split_along(1, group.index, group.size)
            names.append(name)
    return names
