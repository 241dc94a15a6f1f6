"""SequenceShard: what a rank of the cp axis holds of each sequence, and the attention that sees the rest.

Under context parallelism every tensor of a micro-batch that runs along the sequence ([rows, seq, ...]:
token ids, targets) is cut on this rank to its part of the sequence by the load-balanced split
(paratrain.context_parallel.layout: 2 x cp chunks, rank r holding chunks r and 2cp - 1 - r). Everything
that is per token (embeddings, norms, MLPs, the loss) then runs on that part unchanged; what looks
along the sequence takes the shard as a paratrain.nn.sequence.SequenceSplit, wired by the model's
recipe (Recipe.split_sequence, e.g. the GPT's gpt_split_sequence):

    positions(n)    the global positions of this rank's n tokens (rotary tables, dropout keys)
    attention_core  causal attention of this rank's queries over every rank's keys and values:
                    ring attention (blocks of K/V passed round the cp ranks, merged by log-sum-exp),
                    Ulysses (all-to-all from sequence shards to head shards and back) or USP (Ulysses
                    inside groups of cp ranks, a ring across them)
    gather, sum     the whole sequence of a small tensor, and a sum over the cp ranks (MoE routing:
                    per-sequence capacity and load balancing)

Every rank's positions follow from (sequence length, cp) alone, so attention never asks the other
ranks where their tokens are: no collective and no host synchronisation for them. With balance
'documents' (ParallelConfig.cp_balance) a micro-batch of packed documents is split by its documents' attention
work instead (layout.document_split, computed on every rank from the whole micro-batch's positions: one copy
to the host), and its positions travel as a paratrain.nn.documents.Documents whose `split` says where the
rank's tokens sit; attention reads them there. What reads positions without the documents (keyed dropout
masks, MoE capacity, multi-token prediction's shift) is refused with that balance before launch
(paratrain.config.model_rules).

The engine shards each micro-batch (shard_batch) and sums the loss and the token count over dp x cp,
so the step's loss is the mean over the global batch's tokens, whatever cp is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from paratrain.comm import all_gather_async, all_reduce
from paratrain.context_parallel.layout import document_split, local_positions, shard_sequence
from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.ulysses import ulysses_attention
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.context_parallel.usp import usp_attention
from paratrain.nn.documents import Documents, WindowSplit
from paratrain.nn.dropout import KeyedDropout
from paratrain.topology.mesh import AxisGroup


@functools.lru_cache(maxsize=256)
def _group_positions(seq_len: int, cp: int) -> torch.Tensor:
    """int64 [cp, seq_len / cp] on the CPU: row r the positions rank r holds (read-only: shared)."""
    return torch.stack([local_positions(seq_len, r, cp) for r in range(cp)])


@functools.lru_cache(maxsize=256)
def _positions_on(seq_len: int, rank: int, cp: int, device: torch.device) -> torch.Tensor:
    """int64 [seq_len / cp] on `device`, a storage of its own (read-only: shared by every layer)."""
    return _group_positions(seq_len, cp)[rank].to(device, copy=True)


@dataclass(frozen=True)
class SequenceShard:
    group: AxisGroup
    """The cp ranks that split one sequence."""
    mode: str = "ring"
    """'ring', 'ulysses' or 'usp' (paratrain.config.parallel.CP_MODES)."""
    usp: tuple[AxisGroup, AxisGroup] | None = None
    """mode 'usp': (this rank's Ulysses group, its ring group), the mesh's cp_ulysses and cp_ring."""
    balance: str = "positions"
    """'positions': the load-balanced causal split for every micro-batch; 'documents': micro-batches of packed
    documents split by their attention work (paratrain.config.parallel.CP_BALANCES)."""

    def __post_init__(self) -> None:
        if (self.mode == "usp") != (self.usp is not None):
            raise ValueError(f"a SequenceShard in mode {self.mode!r} takes the (Ulysses, ring) groups of USP "
                             f"{'and got none' if self.usp is None else 'only in mode usp'}")
        if self.balance not in ("positions", "documents"):
            raise ValueError(f"a SequenceShard balances 'positions' or 'documents', got {self.balance!r}")

    @property
    def parts(self) -> int:
        return self.group.size

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """int64 [local_len]: the positions in the whole sequence of this rank's tokens, in its order."""
        return _positions_on(local_len * self.group.size, self.group.index, self.group.size, torch.device(device))

    def group_positions(self, local_len: int) -> torch.Tensor:
        """int64 [cp, local_len] on the CPU: every rank's positions, row r rank r's."""
        return _group_positions(local_len * self.group.size, self.group.size)

    def shard_batch(self, micro: Any) -> Any:
        """This rank's part of every tensor of a micro-batch along dim 1 (the sequence). Balance 'documents', on
        (inputs, targets, positions) or a mapping with "positions": the documents' split, the positions given
        back as a Documents carrying it."""
        documents = _documents_of(micro) if self.balance == "documents" else None
        if documents is not None:
            host = documents.reshape(-1, documents.shape[-1]).to("cpu", torch.int64)
            everyone = document_split(host, self.group.size)
            starts = tuple(torch.nonzero(host[0] == 0).flatten().tolist()) if bool((host == host[0]).all()) else None
            split = WindowSplit(everyone[self.group.index].to(documents.device), everyone, starts)
            if isinstance(micro, Mapping):
                return {k: self._shard(v, split, k == "positions") for k, v in micro.items()}
            return type(micro)(self._shard(t, split, i == 2) for i, t in enumerate(micro))  # type: ignore[call-arg]
        if isinstance(micro, torch.Tensor):
            return self._shard(micro)
        if isinstance(micro, Mapping):
            return {k: self._shard(v) for k, v in micro.items()}
        return type(micro)(self._shard(t) for t in micro)  # type: ignore[call-arg]

    def _shard(self, tensor: torch.Tensor, split: WindowSplit | None = None,
               documents: bool = False) -> torch.Tensor | Documents:
        if tensor.dim() < 2:
            raise ValueError(f"under context parallelism every tensor of a batch runs along the sequence "
                             f"([rows, seq, ...], the sequence split over cp = {self.group.size}); got shape "
                             f"{tuple(tensor.shape)}")
        if split is None:
            return shard_sequence(tensor, 1, self.group.index, self.group.size)
        mine = tensor.index_select(1, split.mine)
        return Documents(mine, split) if documents else mine

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               dropout: KeyedDropout | None = None, documents: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """Causal attention for this rank's q [B, H, n, hd] over the whole sequence's k, v [B, Hkv, n, hd]
        (each rank holds n of its positions): [B, H, n, hd]. dropout: on the attention probabilities, keyed
        by (row, head, query position, key position) as one process draws them. documents: [B, n], this
        rank's tokens' positions in their packed documents (paratrain.nn.documents): attention inside them;
        a Documents with a split (balance 'documents'): the tokens sit at its window positions."""
        n = q.shape[-2]
        split = documents.split if isinstance(documents, Documents) else None
        documents = Documents.tensor(documents)
        if split is not None:
            positions, everyone, starts = split.mine, split.everyone, split.starts
        else:
            positions, everyone, starts = self.positions(n, q.device), self.group_positions(n), None
        spec = AttentionSpec(causal=True, scale=scale, dropout=dropout, documents=documents, document_starts=starts)
        if self.usp is not None:
            return usp_attention(q, k, v, *self.usp, group_positions=everyone, spec=spec)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.group, q_positions=positions, group_positions=everyone, spec=spec)
        return ring_attention(q, k, v, self.group, q_positions=positions, group_positions=everyone, spec=spec)

    def attention_core(self, dropout: nn.Module | None = None) -> nn.Module:
        """A module that stands where a model's attention core (softmax(q k^T) v) stood; dropout: that
        core's KeyedDropout on the probabilities (kept under its name, with its splits)."""
        if dropout is not None and not isinstance(dropout, KeyedDropout):
            raise TypeError(f"context parallelism draws attention dropout by position: the core's dropout must be a "
                            f"paratrain.nn.KeyedDropout, got {type(dropout).__name__}")
        return ContextParallelCore(self, dropout)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x with this rank's n tokens along `dim` -> every rank's n * cp, in position order (one
        all-gather over cp; not differentiable)."""
        cp, n = self.group.size, x.shape[dim]
        flat = torch.empty(cp * x.numel(), dtype=x.dtype, device=x.device)
        all_gather_async(flat, x.detach().contiguous().view(-1), self.group).wait()
        parts = flat.view(cp, *x.shape)
        in_rank_order = torch.cat(list(parts.unbind(0)), dim=dim)
        order = torch.argsort(self.group_positions(n).flatten()).to(x.device)
        return in_rank_order.index_select(dim, order)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the cp ranks (a new tensor; not differentiable)."""
        total = x.detach().clone()
        all_reduce(total, self.group)
        return total

    def within(self, outer: Any) -> SequenceShard:
        raise ValueError("context parallelism splits the whole sequence: no split lies outside it")


class ContextParallelCore(nn.Module):
    """softmax(q k^T / sqrt(hd) + causal mask) v over the whole sequence, for this rank's queries
    (SequenceShard.attend). It holds no parameters, so the model's names do not change; `dropout`, the
    replaced core's, keeps its name and its tensor-parallel split of the heads."""

    def __init__(self, shard: SequenceShard, dropout: KeyedDropout | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """documents: packed documents (this rank's tokens' positions in them, [B, n])."""
        dropping = self.dropout is not None and self.dropout.training and self.dropout.p > 0
        return self.shard.attend(q, k, v, dropout=self.dropout if dropping else None, documents=documents)


def _documents_of(micro: Any) -> torch.Tensor | None:
    """The packed documents' positions [B, S] of a micro-batch: the third of (inputs, targets, positions), or a
    mapping's "positions", integers; None without them."""
    if isinstance(micro, Mapping):
        found = micro.get("positions")
    else:
        found = micro[2] if isinstance(micro, (tuple, list)) and len(micro) == 3 else None
    if found is not None and (not isinstance(found, torch.Tensor) or found.is_floating_point() or found.dim() != 2):
        raise ValueError(f"cp_balance documents splits a micro-batch by its packed documents' positions: integers "
                         f"[rows, seq] as the third of (inputs, targets, positions) (paratrain.nn.documents); got "
                         f"{type(found).__name__} {getattr(found, 'dtype', '')} {tuple(getattr(found, 'shape', ()))}: "
                         "pass positions there, or use cp_balance positions")
    return found
