"""Ring attention on the cp axis (Liu et al. 2023, arXiv 2310.01889; Li et al. 2021, arXiv 2105.13120):
each rank keeps its queries and passes its key/value block round the ring, so after cp steps every query
has met every key, and no rank ever holds more than two blocks of keys.

Layouts (B batch, H query heads, Hkv key/value heads, H % Hkv == 0, S_l this rank's positions, D head dim):

    q [B, H, S_l, D] at q_positions [S_l];  k, v [B, Hkv, S_l, D] at kv_positions [S_l]  (any global positions:
    paratrain.context_parallel.layout's splits or any permutation; the same S_l on every rank)
    out [B, H, S_l, D]: attention of this rank's queries over the keys of the whole group

Forward. At step s = 0 .. cp - 1 rank i holds the K/V block of rank i - s (mod cp); it posts the block's
hop to rank i + 1 (and the receive from i - 1) before computing on it, so the transfer overlaps the
compute. Each block gives a partial (out_s, lse_s) (paratrain.context_parallel.block), merged exactly:

    lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) out_s

exp(lse_s - lse) is block s's share of each query's softmax mass; a query that sees no key of block s has
lse_s = -inf and weight 0. The causal mask compares global positions (key position <= query position), so
it is right whatever chunks meet. Keys later than every query and queries earlier than every key of a
block are left out of its compute (they would only meet masked pairs), and a block where none remain is
skipped; every block still travels the whole ring, so every rank enters the same point-to-point
operations in the same order.

Backward (flash-attention's recomputation; only q, k, v, out, lse are kept). With P_s = exp(scale q k_s^T
- lse) block s's exact probabilities in the whole softmax and delta = rowsum(dO * out):

    dq = sum_s scale (P_s * (dO v_s^T - delta)) k_s,   dk_s = scale dS_s^T q,   dv_s = P_s^T dO  (per rank)

dq accumulates locally. The K/V blocks go round the ring again, each followed by an accumulator of its
(dk, dv): every rank adds its queries' share and passes it on, and after cp hops it is home, summed over
every rank's queries.

Load balance. Under a causal mask, with c = S / (2 cp): in the load-balanced split (rank r holds chunks
r and 2 cp - 1 - r) the block from any rank j != r meets rank r's queries in exactly two whole chunk
pairs (j < r: both of r's chunks see j's early chunk; j > r: r's late chunk sees both of j's), and its
own block in two triangles and one whole pair: every rank does 2 c^2 (+ c on the diagonal) pairs of work
at every step, and the trimming above computes just those 2 c^2 off the diagonal. In the contiguous split
rank r meets only the blocks of ranks j <= r: rank cp - 1 computes at every step, rank 0 at one.

Point-to-point bytes per rank, e the element size: forward (cp - 1) hops of 2 e B Hkv S_l D (k and v);
backward (cp - 1) such hops for k, v and cp for (dk, dv); plus one all-gather of the kv positions
(8 S_l bytes per rank) per forward.

The block kernel is plain matmul and softmax in the input dtype (float64 exact on CPU); a fused GPU kernel
returning the log-sum-exp would drop in at block_attention / block_attention_backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.collectives import Pending, all_gather_async
from paratrain.context_parallel.block import Scoring, block_attention, block_attention_backward, merge_partials
from paratrain.topology.mesh import AxisGroup


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, *,
                   q_positions: torch.Tensor, kv_positions: torch.Tensor | None = None, causal: bool = True,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of `group` (the cp axis).

    q [B, H, S_l, D], k, v [B, Hkv, S_l, D] (H % Hkv == 0: GQA, q head h reads kv head h // (H / Hkv)),
    q_positions [S_l] and kv_positions [S_l] (default q_positions) the global positions of this rank's rows,
    LongTensors on q's device -> out [B, H, S_l, D]. causal: key position <= query position. scale:
    1 / sqrt(D) by default. Collective over `group`: every rank calls it with the same shapes and flags.
    """
    kv_positions = q_positions if kv_positions is None else kv_positions
    _check_shapes(q, k, v, q_positions, kv_positions)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, q_positions, kv_positions, Scoring(causal, scale))


@dataclass(frozen=True)
class _Step:
    """One ring step: the K/V block it holds and the part of it that can meet this rank's queries."""

    source: int
    """The group index of the rank whose K/V block this step holds."""
    k_pos: torch.Tensor
    rows: torch.Tensor | None
    """The query rows that see at least one key of the block (None: all)."""
    cols: torch.Tensor | None
    """The key columns that at least one query sees (None: all)."""
    skip: bool
    """No query sees any key: nothing to compute (the block still passes on)."""


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                q_positions: torch.Tensor, kv_positions: torch.Tensor, scoring: Scoring) -> torch.Tensor:
        steps = _plan(q_positions, _gather_positions(kv_positions, group), group, causal=scoring.causal)
        out, lse = _forward(q, k, v, q_positions, steps, group, scoring)
        ctx.save_for_backward(q, k, v, q_positions, out, lse)
        ctx.steps, ctx.group, ctx.scoring = steps, group, scoring
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dq, dk, dv = _backward(ctx.saved_tensors, grad_out.contiguous(), ctx.steps, ctx.group, ctx.scoring)
        return dq, dk, dv, None, None, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, steps: list[_Step],
             group: AxisGroup, scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, H, S_l, D], lse [B, H, S_l]) merged over every block of the ring."""
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)  # no key seen yet
    kv = torch.stack([k, v])  # [2, B, Hkv, S_l, D]: one message per hop
    for s, step in enumerate(steps):
        hop = _pass_on(kv, group) if s + 1 < len(steps) else None  # posted before the compute it overlaps
        if not step.skip:
            q_b, q_pos_b = _take(q, step.rows), _take(q_pos, step.rows)
            out_b, lse_b = block_attention(q_b, _take(kv[0], step.cols), _take(kv[1], step.cols), q_pos_b,
                                           _take(step.k_pos, step.cols), scoring)
            merged_out, merged_lse = merge_partials(_take(out, step.rows), _take(lse, step.rows), out_b, lse_b)
            out, lse = _put(out, step.rows, merged_out), _put(lse, step.rows, merged_lse)
        if hop is not None:
            kv = _arrive(hop)
    return out, lse


def _backward(saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor, steps: list[_Step], group: AxisGroup,
              scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """saved = (q, k, v, q_pos, out, lse) of the forward -> (dq [B, H, S_l, D], dk, dv [B, Hkv, S_l, D]):
    the K/V blocks go round again, each followed by its (dk, dv) accumulator, which comes home after cp
    hops."""
    q, k, v, q_pos, out, lse = saved
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    d_kv = torch.zeros_like(kv)  # at step 0 the accumulator of this rank's own block
    d_hop: tuple[torch.Tensor, list[Pending]] | None = None
    for s, step in enumerate(steps):
        hop = _pass_on(kv, group) if s + 1 < len(steps) else None
        share = None
        if not step.skip:
            rows = step.rows
            dq_b, dk_b, dv_b = block_attention_backward(
                _take(q, rows), _take(kv[0], step.cols), _take(kv[1], step.cols), _take(q_pos, rows),
                _take(step.k_pos, step.cols), (_take(out, rows), _take(lse, rows)), _take(grad_out, rows), scoring)
            dq = dq + dq_b if rows is None else dq.index_add_(2, rows, dq_b)
            share = torch.stack([dk_b, dv_b])
        if d_hop is not None:  # the previous rank's accumulator for this step's block
            d_kv = _arrive(d_hop)
        if share is not None:
            d_kv = d_kv + share if step.cols is None else d_kv.index_add_(3, step.cols, share)
        d_hop = _pass_on(d_kv, group) if group.size > 1 else None  # a ring of one passes nothing
        if hop is not None:
            kv = _arrive(hop)
    d_kv = _arrive(d_hop) if d_hop is not None else d_kv
    return dq, d_kv[0], d_kv[1]


def _plan(q_pos: torch.Tensor, kv_pos: torch.Tensor, group: AxisGroup, *, causal: bool) -> list[_Step]:
    """The ring's steps for this rank, from every rank's kv positions kv_pos [cp, S_l]."""
    steps = []
    for s in range(group.size):
        source = (group.index - s) % group.size
        k_pos = kv_pos[source]
        if not causal:
            steps.append(_Step(source, k_pos, None, None, skip=False))
            continue
        rows = torch.nonzero(q_pos >= k_pos.min()).flatten()  # queries at or after the block's first key
        cols = torch.nonzero(k_pos <= q_pos.max()).flatten()  # keys at or before this rank's last query
        steps.append(_Step(source, k_pos, None if len(rows) == len(q_pos) else rows,
                           None if len(cols) == len(k_pos) else cols, skip=len(rows) == 0))
    return steps


def _gather_positions(kv_pos: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Every rank's kv positions, [cp, S_l] in group order: they say which pairs of each block can meet."""
    if group.size == 1:
        return kv_pos.unsqueeze(0)
    gathered = torch.empty(group.size * kv_pos.numel(), dtype=kv_pos.dtype, device=kv_pos.device)
    all_gather_async(gathered, kv_pos.contiguous(), group).wait()
    return gathered.view(group.size, -1)


def _pass_on(tensor: torch.Tensor, group: AxisGroup) -> tuple[torch.Tensor, list[Pending]]:
    """Post one hop of the ring: `tensor` to the next rank, the previous rank's into a new buffer."""
    received = torch.empty_like(tensor)
    after, before = group.ranks[(group.index + 1) % group.size], group.ranks[(group.index - 1) % group.size]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, after, group.pg),
                                    dist.P2POp(dist.irecv, received, before, group.pg)])
    return received, [Pending("ring send", group, tensor, works[0]), Pending("ring receive", group, received, works[1])]


def _arrive(hop: tuple[torch.Tensor, list[Pending]]) -> torch.Tensor:
    """Wait for a hop's send and receive; -> the received tensor."""
    received, pending = hop
    for p in pending:
        p.wait()
    return received


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x's sequence entries at `index` (the sequence is the last dim of a position vector, dim 2 else)."""
    if index is None:
        return x
    return x.index_select(0 if x.dim() == 1 else 2, index)


def _put(x: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """x with its sequence entries (dim 2) at `index` replaced by values (all of them: None)."""
    return values if index is None else x.index_copy(2, index, values)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                  kv_positions: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention takes q [B, H, S_l, D] and k, v [B, Hkv, S_l, D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share B and D, and "
                         f"the kv heads ({k.shape[1]}) must divide the q heads ({q.shape[1]}) (GQA)")
    if q_positions.shape != (q.shape[2],) or kv_positions.shape != (k.shape[2],):
        raise ValueError(f"ring_attention: q_positions {tuple(q_positions.shape)} and kv_positions "
                         f"{tuple(kv_positions.shape)} must be 1-D with one global position per row of q "
                         f"({q.shape[2]}) and of k ({k.shape[2]})")
