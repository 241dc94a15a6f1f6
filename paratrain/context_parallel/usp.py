"""USP, unified sequence parallelism (Fang and Zhao 2024, arXiv 2405.07719; Megatron-Core's hierarchical
`a2a+p2p` context parallelism): Ulysses inside groups of U consecutive cp ranks, a ring across the R = cp / U
groups. Ulysses alone needs the heads to divide by cp, and a ring alone pays cp - 1 hops of latency a step; USP
needs only U to divide the heads, and its ring is R long, each hop U times the bytes of ring attention's.

Ranks (cp = U x R, cp index i): Ulysses group i // U, at place u = i % U; ring group u, at place r = i // U
(paratrain.topology.dims.ParallelDims.cp_split: a Ulysses group is U consecutive cp ranks, so on a node it stays
on the fastest links, and a ring joins one rank of each).

    q [B, H, S_l, D]       this rank's shard of the load-balanced split over cp (2 cp chunks)
      | Ulysses all-to-all over the U ranks of its group (paratrain.context_parallel.ulysses)
    q [B, H/U, U S_l, D]   head block u of the group's U shards, concatenated in group order; k, v likewise
                           (kv heads split over U, or replicated to U when fewer: Ulysses' GQA rule)
      | ring attention over the R ranks at place u of every group (paratrain.context_parallel.ring), at the
      | positions of the group's U shards: row r of the cp ranks' positions [cp, S_l] viewed [R, U S_l]
    o [B, H/U, U S_l, D]
      | the reverse all-to-all
    o [B, H, S_l, D]

Load balance: ring place r holds chunks rU .. rU + U - 1 and their mirrors 2 cp - 1 - rU - u, U early and U late
chunks, so under the causal mask the block of any other place meets its queries in 2 U^2 whole chunk pairs, as
ring attention's balanced split does at cp = R with chunks U times longer.

Bytes per rank, e the element size (as paratrain.comm.volume counts them):
    all-to-all (Ulysses group): e B S_l D (2 H + 2 max(Hkv, U)) forward, the same backward
    ring (point-to-point):      forward (R - 1) hops of 2 e B max(Hkv, U) S_l D (its k and v);
                                backward (R - 1) such hops for k, v and R for their gradients' accumulator
    documents:                  one all-gather of the [B, S_l] document positions over the Ulysses group (int64)
Positions travel with no collective: every rank's are known from (sequence length, cp).

Dropout is keyed by (row, head of the tp rank, query position, key position): a ring block's probabilities are
head block u of the tp rank's heads (ring_attention's head_block), so the mask is the one a process draws.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.context_parallel.ulysses import check_ulysses_heads, gathered_sequence, heads_to_sequence, sequence_to_heads
from paratrain.topology.mesh import AxisGroup


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: AxisGroup, ring: AxisGroup, *,
                  group_positions: torch.Tensor, spec: AttentionSpec = AttentionSpec()) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence of the cp group (ulysses x ring ranks).

    q [B, H, S_l, D], k, v [B, Hkv, S_l, D]: this rank's tokens; group_positions [cp, S_l] on the host: every cp
    rank's global positions, row i cp index i (a SequenceShard's group_positions). Returns [B, H, S_l, D], equal to
    single-process attention over the whole sequence at those positions (spec: AttentionSpec's causal mask, scale,
    keyed dropout drawn as one process draws it, packed documents and their starts). Collective over both groups."""
    u, r = ulysses.size, ring.size
    cp, local = u * r, q.shape[2]
    check_ulysses_heads(q.shape[1], k.shape[1], u)
    if group_positions.shape != (cp, local):
        raise ValueError(f"usp_attention: group_positions {tuple(group_positions.shape)} must be [cp, S_l] = "
                         f"[{cp}, {local}] (cp = {u} Ulysses x {r} ring), every cp rank's positions")
    if k.shape[1] < u:  # Ulysses' GQA rule: each kv head copied to the U / Hkv places whose q heads read it
        k, v = (t.repeat_interleave(u // k.shape[1], dim=1) for t in (k, v))
    heads = q.shape[1]
    q, k, v = (sequence_to_heads(t, ulysses) for t in (q, k, v))  # [B, H/U, U S_l, D], the group's shards in order
    ring_positions = group_positions.reshape(r, u * local)  # place r: cp ranks rU .. rU + U - 1, in group order
    documents = None if spec.documents is None else gathered_sequence(spec.documents, ulysses)
    out = ring_attention(q, k, v, ring, q_positions=ring_positions[ring.index].to(q.device),
                         group_positions=ring_positions,
                         spec=replace(spec, documents=documents, head_block=(ulysses.index, heads)))
    return heads_to_sequence(out, ulysses)
