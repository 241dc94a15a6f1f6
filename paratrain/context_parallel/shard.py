"""SequenceShard: what a rank of the cp axis holds of each sequence, and the attention that sees the rest.

Under context parallelism every tensor of a micro-batch that runs along the sequence ([rows, seq, ...]:
token ids, targets) is cut on this rank to its part of the sequence by the load-balanced split
(paratrain.context_parallel.layout: 2 x cp chunks, rank r holding chunks r and 2cp - 1 - r). Everything
that is per token (embeddings, norms, MLPs, the loss) then runs on that part unchanged; only two
things must know where the tokens sit in the whole sequence, and the model's recipe wires both
(Recipe.split_sequence, e.g. GPT.split_sequence):

    positions(n)   the global positions of this rank's n tokens (rotary tables are indexed by them)
    attend(q, k, v) causal attention of this rank's queries over every rank's keys and values:
                   ring attention (blocks of K/V passed round the cp ranks, merged by log-sum-exp) or
                   Ulysses (all-to-all from sequence shards to head shards and back)

The engine shards each micro-batch (shard_batch) and sums the loss and the token count over dp x cp,
so the step's loss is the mean over the global batch's tokens, whatever cp is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from paratrain.context_parallel.layout import local_positions, shard_sequence
from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.ulysses import ulysses_attention
from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class SequenceShard:
    group: AxisGroup
    """The cp ranks that split one sequence."""
    mode: str = "ring"
    """'ring' or 'ulysses' (paratrain.config.parallel.CP_MODES)."""

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """int64 [local_len]: the positions in the whole sequence of this rank's tokens, in its order."""
        return local_positions(local_len * self.group.size, self.group.index, self.group.size).to(device)

    def shard_batch(self, micro: Any) -> Any:
        """This rank's part of every tensor of a micro-batch along dim 1 (the sequence)."""
        if isinstance(micro, torch.Tensor):
            return self._shard(micro)
        if isinstance(micro, Mapping):
            return {k: self._shard(v) for k, v in micro.items()}
        return type(micro)(self._shard(t) for t in micro)  # type: ignore[call-arg]

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2:
            raise ValueError(f"under context parallelism every tensor of a batch runs along the sequence "
                             f"([rows, seq, ...], the sequence split over cp = {self.group.size}); got shape "
                             f"{tuple(tensor.shape)}")
        return shard_sequence(tensor, 1, self.group.index, self.group.size)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention for this rank's q [B, H, n, hd] over the whole sequence's k, v (each rank
        holds n of its positions): [B, H, n, hd]."""
        positions = self.positions(q.shape[-2], q.device)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.group, q_positions=positions, causal=True)
        return ring_attention(q, k, v, self.group, q_positions=positions, causal=True)

    def attention_core(self) -> nn.Module:
        """A module that stands where a model's attention core (softmax(q k^T) v) stood."""
        return ContextParallelCore(self)


class ContextParallelCore(nn.Module):
    """softmax(q k^T / sqrt(hd) + causal mask) v over the whole sequence, for this rank's queries
    (SequenceShard.attend). It holds no parameters, so the model's names do not change."""

    def __init__(self, shard: SequenceShard) -> None:
        super().__init__()
        self.shard = shard

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.shard.attend(q, k, v)
