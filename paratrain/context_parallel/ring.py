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
backward (cp - 1) such hops for k, v and cp for (dk, dv); plus, unless the caller gives every rank's
positions (group_positions: a SequenceShard does), one all-gather of the kv positions (8 S_l bytes per
rank) per forward.

On the CPU each block runs on the fused flash kernel, cut into runs of consecutive positions
(paratrain.context_parallel.fused: O(S) memory, no [S_l, S_l] scores held; packed documents too when every row
has the same); with keyed attention dropout, documents that differ by row, positions in many short runs, or on
CUDA (no fused path yet) the plain block kernel (paratrain.context_parallel.block) computes the rows and columns
of a block that can meet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.collectives import Pending, all_gather_async
from paratrain.context_parallel.block import Scoring, block_attention, block_attention_backward, merge_partials
from paratrain.context_parallel.fused import fused_available, fused_block_backward, fused_block_forward
from paratrain.context_parallel.ring_plan import Step, plan
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.nn.dropout import KeyedDropout
from paratrain.topology.mesh import AxisGroup


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, *,
                   q_positions: torch.Tensor, kv_positions: torch.Tensor | None = None,
                   group_positions: torch.Tensor | None = None, spec: AttentionSpec = AttentionSpec()) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of `group` (the cp axis).

    q [B, H, S_l, D], k, v [B, Hkv, S_l, D] (H % Hkv == 0: GQA, q head h reads kv head h // (H / Hkv)),
    q_positions [S_l] and kv_positions [S_l] (default q_positions) the global positions of this rank's rows,
    LongTensors on q's device -> out [B, H, S_l, D]. Collective over `group`: every rank calls it with the same
    shapes and spec. group_positions: every rank's kv positions, [cp, S_l] on the CPU, when the caller knows them
    (a SequenceShard does): then no rank asks the others, and the ring's plan is made on the host without
    waiting for the device. spec: causal, scale, dropout (drawn per block at its (query, key) positions of the
    whole sequence, cp S_l long), documents and their starts, the dropout's head block (AttentionSpec).
    """
    causal, dropout, documents, document_starts = spec.causal, spec.dropout, spec.documents, spec.document_starts
    if documents is not None and (not causal or documents.shape != (q.shape[0], q.shape[2])):
        raise ValueError(f"ring_attention: documents must be [B, S_l] = [{q.shape[0]}, {q.shape[2]}] positions of "
                         f"causal attention's queries, got {tuple(documents.shape)} (causal={causal})")
    if group_positions is not None and kv_positions is not None:
        raise ValueError("ring_attention: group_positions gives every rank's positions, its queries' and keys' "
                         "alike; pass kv_positions only without it")
    kv_positions = q_positions if kv_positions is None else kv_positions
    _check_shapes(q, k, v, q_positions, kv_positions)
    scale = spec.scale_of(q.shape[-1])
    if group_positions is None:
        group_positions, host_q = _gather_positions(kv_positions, group), q_positions
    elif group_positions.shape != (group.size, k.shape[2]):
        raise ValueError(f"ring_attention: group_positions {tuple(group_positions.shape)} must be [cp, S_l] = "
                         f"[{group.size}, {k.shape[2]}], every rank's positions")
    else:
        host_q = group_positions[group.index]
    steps = plan(host_q, group_positions, group, causal=causal, device=q.device,
                  fused=dropout is None and (documents is None or document_starts is not None) and fused_available(
                      q.device, q.dtype), heads=q.shape[0] * q.shape[1], starts=document_starts or ())
    block = spec.head_block
    heads = None if block is None else (torch.arange(block[0] * q.shape[1], (block[0] + 1) * q.shape[1],
                                                     device=q.device), block[1])
    drop = None if dropout is None else functools.partial(_drop_block, dropout, group.size * k.shape[2], heads)
    return _RingAttention.apply(q, k, v, q_positions, RingCall(group, tuple(steps), Scoring(causal, scale, drop),
                                                               documents))


@dataclass(frozen=True, eq=False)
class RingCall:
    """What one ring_attention call's forward and backward share besides its tensors: the cp group, the ring's plan
    (a Step per hop), how a block's scores are formed and dropped, and the queries' document positions [B, S_l]."""

    group: AxisGroup
    steps: tuple[Step, ...]
    scoring: Scoring
    documents: torch.Tensor | None


def _drop_block(dropout: KeyedDropout, seq_len: int, heads: tuple[torch.Tensor, int] | None, probs: torch.Tensor,
                q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """A [B, H, Sq, Sk] block of attention probabilities at (q_pos, k_pos) of the whole sequence (its heads at
    heads = (indices, count) when given), dropped."""
    return dropout.at(probs, {2: (q_pos, seq_len), 3: (k_pos, seq_len), **({} if heads is None else {1: heads})})


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                call: RingCall) -> torch.Tensor:
        out, lse = _forward(q, k, v, q_positions, call)
        ctx.save_for_backward(q, k, v, q_positions, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dq, dk, dv = _backward(ctx.saved_tensors, grad_out.contiguous(), ctx.call)
        return dq, dk, dv, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
             call: RingCall) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, H, S_l, D] in q's dtype, lse [B, H, S_l] in at least float32) merged over every block of
    the ring (accumulated in at least float32)."""
    group, scoring, documents = call.group, call.scoring, call.documents
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=wide, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=wide, device=q.device)  # no key seen yet
    kv = torch.stack([k, v])  # [2, B, Hkv, S_l, D]: one message per hop
    for s, step in enumerate(call.steps):
        hop = _pass_on(kv, group) if s + 1 < len(call.steps) else None  # posted before the compute it overlaps
        if step.pieces is not None:
            fused_block_forward(q, kv[0], kv[1], step.pieces, scale=scoring.scale, out=out, lse=lse)
        elif not step.skip:
            k_b, v_b, k_pos_b = _take(kv[0], step.cols), _take(kv[1], step.cols), _take(step.k_pos, step.cols)
            for rows in step.rows:
                out_b, lse_b = block_attention(_take(q, rows), k_b, v_b, _take(q_pos, rows), k_pos_b, scoring,
                                               _rows_of(documents, rows))
                merged_out, merged_lse = merge_partials(_take(out, rows), _take(lse, rows), out_b, lse_b)
                out, lse = _put(out, rows, merged_out), _put(lse, rows, merged_lse)
        if hop is not None:
            kv = _arrive(hop)
    return out.to(q.dtype), lse


def _backward(saved: tuple[torch.Tensor, ...], grad_out: torch.Tensor,
              call: RingCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """saved = (q, k, v, q_pos, out, lse) of the forward -> (dq [B, H, S_l, D], dk, dv [B, Hkv, S_l, D]):
    the K/V blocks go round again, each followed by its (dk, dv) accumulator, which comes home after cp
    hops."""
    q, k, v, q_pos, out, lse = saved
    group, scoring, documents = call.group, call.scoring, call.documents
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    d_kv = torch.zeros_like(kv)  # at step 0 the accumulator of this rank's own block
    d_hop: tuple[torch.Tensor, list[Pending]] | None = None
    for s, step in enumerate(call.steps):
        hop = _pass_on(kv, group) if s + 1 < len(call.steps) else None
        share: torch.Tensor | None = None  # this rank's queries' share of the block's (dk, dv), computed
        cols = step.cols  # while the previous rank's accumulator arrives
        if step.pieces is not None:
            share, cols = torch.zeros_like(kv), None
            fused_block_backward(q, kv[0], kv[1], step.pieces, (out, lse, grad_out), scale=scoring.scale, dq=dq,
                                 dkv=share)
        elif not step.skip:
            k_b, v_b, k_pos_b = _take(kv[0], cols), _take(kv[1], cols), _take(step.k_pos, cols)
            for rows in step.rows:
                dq_b, dk_b, dv_b = block_attention_backward(
                    _take(q, rows), k_b, v_b, _take(q_pos, rows), k_pos_b,
                    (_take(out, rows), _take(lse, rows).to(q.dtype), _take(grad_out, rows)), scoring,
                    _rows_of(documents, rows))
                dq = dq + dq_b if rows is None else dq.index_add_(2, rows, dq_b)
                share = torch.stack([dk_b, dv_b]) if share is None else share + torch.stack([dk_b, dv_b])
        if d_hop is not None:  # the previous rank's accumulator for this step's block
            d_kv = _arrive(d_hop)
        if share is not None:
            d_kv = d_kv + share if cols is None else d_kv.index_add_(3, cols, share)
        d_hop = _pass_on(d_kv, group, tag=1) if group.size > 1 else None  # a ring of one passes nothing
        if hop is not None:
            kv = _arrive(hop)
    d_kv = _arrive(d_hop) if d_hop is not None else d_kv
    return dq, d_kv[0], d_kv[1]


def _gather_positions(kv_pos: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Every rank's kv positions, [cp, S_l] in group order: they say which pairs of each block can meet."""
    if group.size == 1:
        return kv_pos.unsqueeze(0)
    gathered = torch.empty(group.size * kv_pos.numel(), dtype=kv_pos.dtype, device=kv_pos.device)
    all_gather_async(gathered, kv_pos.contiguous(), group).wait()
    return gathered.view(group.size, -1)


def _pass_on(tensor: torch.Tensor, group: AxisGroup, *, tag: int = 0) -> tuple[torch.Tensor, list[Pending]]:
    """Post one hop of the ring: `tensor` to the next rank, the previous rank's into a new buffer. tag:
    K/V blocks 0, their (dK, dV) accumulators 1 (both travel between the same ranks in backward)."""
    received = torch.empty_like(tensor)
    after, before = (group.index + 1) % group.size, (group.index - 1) % group.size
    if tensor.is_cuda:  # NCCL: the pair as one grouped launch
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, group.ranks[after], group.pg, tag),
                                        dist.P2POp(dist.irecv, received, group.ranks[before], group.pg, tag)])
    else:  # gloo (and a dry run's fake group): the process group's own calls, by index in the group
        works = [group.pg.send([tensor], after, tag), group.pg.recv([received], before, tag)]
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


def _rows_of(documents: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """The document positions [B, S_l] of the query rows at `index` (all of them: None)."""
    return documents if documents is None or index is None else documents.index_select(1, index)


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
