"""What a layer needs to know when a rank holds only part of each sequence (context parallelism).

Under context parallelism (paratrain.context_parallel) each rank of the cp axis holds `parts` pieces
of every sequence: the tokens at some global positions, in the rank's own order. Per-token layers
(embeddings, norms, MLPs, the loss) run unchanged; the few that look along the sequence take a
SequenceSplit, this protocol, so that nothing below the strategies imports them:

    positions(n)     the global positions of this rank's n tokens: rotary tables, dropout keys
    attend           attention of this rank's queries over every rank's keys (ring or Ulysses);
    attention_core   the same as a module, to stand where a model's attention core stood
    gather(x, dim)   the whole sequence of a small tensor, in position order (MoE capacity, which
                     counts each expert's assignments in sequence order)
    sum(x)           a sum over the ranks of one sequence (MoE load balancing, whose fractions are
                     per sequence)
    within(outer)    the split of what another split left the rank (nesting)

paratrain.context_parallel.SequenceShard implements it over the cp group, and
paratrain.tensor_parallel.sequence.SequenceChunks over tp under sequence parallelism (for MoE routing
only: attention runs on the gathered sequence there).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from paratrain.nn.documents import Documents


class SequenceSplit(Protocol):
    @property
    def parts(self) -> int:
        """The ranks one sequence is split over (cp)."""
        ...

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """int64 [local_len]: the positions in the whole sequence of this rank's tokens, in its order."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               documents: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """Causal attention of this rank's q [B, H, n, hd] over every rank's k, v [B, Hkv, n, hd] (GQA: H % Hkv
        == 0); scale: 1 / sqrt(hd) by default; documents: [B, n], this rank's tokens' positions in their packed
        documents (paratrain.nn.documents), attention kept inside each (a Documents with a split: at its window
        positions). -> [B, H, n, hd]."""
        ...

    def attention_core(self, dropout: nn.Module | None = None) -> nn.Module:
        """A module for (q, k, v) [B, H, n, hd] -> [B, H, n, hd]: causal attention of this rank's queries
        over the whole sequence's keys and values; dropout: the replaced core's KeyedDropout on the
        attention probabilities (kept, so its name and its splits stay)."""
        ...

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x [..., n, ...] (this rank's tokens along `dim`) -> [..., n * parts, ...], every rank's, in
        position order. Not differentiable (for routing decisions)."""
        ...

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks of one sequence (a new tensor). Not differentiable."""
        ...

    def within(self, outer: SequenceSplit) -> SequenceSplit:
        """This split applied to the part `outer` leaves the rank (sequence parallelism's chunks of a
        context-parallel part); a split that is always outermost raises."""
        ...


def look_ahead(values: torch.Tensor, k: int, fill: int, *, split: SequenceSplit | None = None,
               documents: torch.Tensor | None = None) -> torch.Tensor:
    """values[B, n] (this rank's tokens of each sequence) -> [B, n]: at each token, the value of the token k places
    later in the whole sequence, or `fill` where that token lies past the sequence's end or, with documents (this
    rank's positions in packed documents, paratrain.nn.documents), in another document. Under a split the whole
    sequence is gathered first (one all-gather of small integers), so the shift crosses the ranks' parts as it would
    in one process: multi-token prediction's inputs and labels (paratrain.models.gpt_mtp). Not differentiable."""
    whole = values if split is None else split.gather(values, 1)
    seq = whole.shape[1]
    shifted = torch.full_like(whole, fill)
    if k < seq:
        later = whole[:, k:]
        if documents is not None:  # the token k later is in the same document iff its position is k more
            where = documents if split is None else split.gather(documents, 1)
            later = torch.where(where[:, k:] - where[:, :seq - k] == k, later, fill)
        shifted[:, :seq - k] = later
    if split is None:
        return shifted
    return shifted.index_select(1, split.positions(values.shape[1], values.device))
