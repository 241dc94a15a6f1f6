"""DeepSpeed-Ulysses attention on the cp axis (Jacobs et al. 2023, arXiv 2309.14509): trade the sequence
split for a head split around attention, so each rank attends over the whole sequence with H / cp heads.

Layouts (B batch, H query heads, Hkv key/value heads, S the whole sequence, S_l = S / cp, D head dim):

    q [B, H, S_l, D]      this rank's sequence shard, at the global positions q_positions [S_l]
      | sequence_to_heads: all-to-all, head block j to rank j, sequence shard i from rank i
    q [B, H/cp, S, D]     head block `index` of the whole sequence, in gathered order (rank 0's
                          shard, rank 1's, ...); k, v likewise with their kv heads (below)
      | causal: sort the sequence by position, attend with is_causal, unsort
    o [B, H/cp, S, D]
      | heads_to_sequence: the reverse all-to-all
    o [B, H, S_l, D]      this rank's sequence shard again

Each rank's shard may hold any positions: the contiguous split (rank r holds [r S_l, (r + 1) S_l)), the
load-balanced one (2 cp chunks, rank r holds chunks r and 2 cp - 1 - r) or any permutation. For causal
attention the ranks' position vectors are all-gathered and the gathered sequence is put in position order
before attention and back after, so the result is single-process attention at those positions (positions
distinct over the group; key position <= query position). Without causality order does not matter.

GQA (q head h reads kv head h // (H / Hkv)): H % cp == 0 always. Hkv % cp == 0: rank j gets kv heads
[j Hkv/cp, (j + 1) Hkv/cp), exactly those its q heads read. Hkv < cp with cp % Hkv == 0: each kv head is
replicated cp / Hkv times (repeat_interleave, whose backward sums the replicas' gradients) to cp heads, and
rank j gets kv head j // (cp / Hkv), the one all its q heads read. Other head counts are refused.

All-to-all bytes per rank, counted as paratrain.comm.volume counts them (the input, own rows included;
(cp - 1) / cp of it crosses the wire), e the element size in bytes:

    forward:  e B S_l D (2 H + 2 max(Hkv, cp))      q, k, v (k, v after any replication), out
    backward: the same                              d out, dq, dk, dv
    causal:   an all-gather of the positions, 8 cp S_l bytes (int64 output), in forward only, unless the
              caller gives every rank's positions (group_positions: a SequenceShard does)

Ring attention (paratrain.context_parallel.ring) moves kv round the ring instead and splits no heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.comm import all_gather_async, all_to_all
from paratrain.nn.documents import document_mask
from paratrain.nn.dropout import KeyedDropout
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.topology.mesh import AxisGroup


def _exchange(blocks: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """blocks [cp, ...]: block j goes to the group's j-th rank; returns [cp, ...], block i from rank i."""
    out = torch.empty_like(blocks)
    rows = [blocks.shape[0] // group.size] * group.size
    all_to_all(out, blocks, group, output_splits=rows, input_splits=rows)
    return out


def _to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[B, H, S_l, D] sequence shard -> [B, H/cp, cp S_l, D] head block of the gathered sequence."""
    cp, (b, h, s, d) = group.size, x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # [cp (to rank), B, H/cp, S_l, D]
    received = _exchange(blocks, group)  # [cp (from rank), B, H/cp, S_l, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _to_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[B, H/cp, cp S_l, D] head block of the gathered sequence -> [B, H, S_l, D] sequence shard."""
    cp, (b, h, s, d) = group.size, x.shape
    blocks = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (to rank), B, H/cp, S_l, D]
    received = _exchange(blocks, group)  # [cp (from rank: head block), B, H/cp, S_l, D]
    return received.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """x [B, H, S_l, D], this rank's sequence shard -> [B, H/cp, cp S_l, D]: head block `group.index`
    of the ranks' shards concatenated in group order. One all-to-all; backward is heads_to_sequence."""
    if x.dim() != 4 or x.shape[1] % group.size:
        raise ValueError(f"sequence_to_heads takes [B, heads, S_local, D] with heads % cp == 0; got shape "
                         f"{tuple(x.shape)} on {group.describe()} (cp = {group.size})")
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """x [B, H/cp, cp S_l, D], a head block of the gathered sequence -> [B, H, S_l, D], this rank's
    sequence shard of every head. One all-to-all; backward is sequence_to_heads."""
    if x.dim() != 4 or x.shape[2] % group.size:
        raise ValueError(f"heads_to_sequence takes [B, heads / cp, S, D] with S % cp == 0; got shape "
                         f"{tuple(x.shape)} on {group.describe()} (cp = {group.size})")
    return _HeadsToSequence.apply(x, group)


def check_ulysses_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Refuse head counts Ulysses cannot split over cp ranks (the module docstring's GQA rule)."""
    if heads % cp:
        raise ValueError(f"Ulysses attention splits the heads over cp: heads % cp must be 0, but {heads} % {cp} "
                         f"= {heads % cp}; choose cp dividing {heads}, or ring attention, which splits no heads")
    if heads % kv_heads:
        raise ValueError(f"grouped-query attention needs heads % kv_heads == 0; got {heads} % {kv_heads}")
    if kv_heads % cp and cp % kv_heads:
        raise ValueError(f"Ulysses attention needs kv_heads % cp == 0 (split) or cp % kv_heads == 0 (replicated); "
                         f"got kv_heads {kv_heads}, cp {cp}; choose cp dividing or divided by {kv_heads}")


def _position_order(q_positions: torch.Tensor, group: AxisGroup, device: torch.device,
                    group_positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) on `device`: gathered[order] is the gathered sequence sorted by global position,
    sorted[inverse] the gathered order again. Positions must be distinct over the group. From
    group_positions [cp, S_l] (every rank's, on the host) when given; else all-gathered."""
    if group_positions is None:
        gathered = torch.empty(group.size * q_positions.numel(), dtype=torch.int64, device=device)
        all_gather_async(gathered, q_positions.to(device, torch.int64).contiguous(), group).wait()
    elif group_positions.shape != (group.size, q_positions.numel()):
        raise ValueError(f"ulysses_attention: group_positions {tuple(group_positions.shape)} must be [cp, S_l] = "
                         f"[{group.size}, {q_positions.numel()}], every rank's positions")
    else:
        gathered = group_positions.flatten()
    order = torch.argsort(gathered)
    ordered = gathered[order]
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise ValueError(f"causal Ulysses attention needs distinct positions over {group.describe()}: every "
                         "token's global position once; a position appears on two ranks or twice on one")
    return order.to(device), torch.argsort(order).to(device)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, *,
                      q_positions: torch.Tensor, group_positions: torch.Tensor | None = None,
                      spec: AttentionSpec = AttentionSpec()) -> torch.Tensor:
    """Attention over the whole sequence of the cp group, from and to this rank's sequence shard.

    q [B, H, S_l, D], k and v [B, Hkv, S_l, D]: the tokens at global positions q_positions [S_l]
    (the same for every batch row; k and v are the same tokens'). Returns [B, H, S_l, D], equal to
    single-process attention (softmax(q kᵀ scale) v, keys at positions <= the query's when spec.causal;
    spec.scale defaults to 1 / sqrt(D)) over the whole sequence at those positions. Collective over `group`.
    group_positions: every rank's positions [cp, S_l] on the host when the caller knows them (a
    SequenceShard does; else they are all-gathered). spec.dropout: a KeyedDropout on the attention
    probabilities (causal only): attention is then written out (the scores, the mask and the
    probabilities of this rank's H / cp heads over the whole sequence are kept), the mask keyed by
    (row, head of this tp rank, query position, key position) as one process draws it. spec.documents: [B, S_l],
    each token's position in its packed document (paratrain.nn.documents; causal only): all-gathered with the
    sequence (8 B S bytes per rank), so the whole sequence's document mask is one process's (the document starts
    and head block of the spec are ring attention's).
    """
    causal, scale, dropout, documents = spec.causal, spec.scale, spec.dropout, spec.documents
    cp, heads, kv_heads = group.size, q.shape[1], k.shape[1]
    check_ulysses_heads(heads, kv_heads, cp)
    if q_positions.shape != (q.shape[2],) or k.shape[2] != q.shape[2] or v.shape != k.shape:
        raise ValueError(f"ulysses_attention takes q [B, H, S_l, D], k, v [B, Hkv, S_l, D] and q_positions [S_l]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_positions {tuple(q_positions.shape)}")
    if (dropout is not None or documents is not None) and not causal:
        raise ValueError("ulysses_attention draws dropout and masks documents for causal attention only")
    if kv_heads < cp:  # replicate: cp heads, one per rank, each the kv head its rank's q heads read
        k, v = (t.repeat_interleave(cp // kv_heads, dim=1) for t in (k, v))
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))  # [B, H/cp or Hkv'/cp, S, D], gathered order
    gqa = q.shape[1] != k.shape[1]
    if not causal:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        return heads_to_sequence(out, group)
    order, inverse = _position_order(q_positions, group, q.device, group_positions)
    q, k, v = (t.index_select(2, order) for t in (q, k, v))  # position order: is_causal is key <= query
    mask = None if documents is None else document_mask(gathered_sequence(documents, group).index_select(1, order))
    if dropout is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=gqa)
    else:
        out = _attention_with_dropout(q, k, v, dropout, scale=scale, head_block=(group.index, heads), mask=mask)
    return heads_to_sequence(out.index_select(2, inverse), group)


def gathered_sequence(documents: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[B, S_l] of every rank -> [B, cp S_l] in gathered order (rank 0's shard, rank 1's, ...): the order
    sequence_to_heads puts the sequence in. Not differentiable (document positions)."""
    flat = torch.empty(group.size * documents.numel(), dtype=documents.dtype, device=documents.device)
    all_gather_async(flat, documents.contiguous().view(-1), group).wait()
    return flat.view(group.size, *documents.shape).permute(1, 0, 2).reshape(documents.shape[0], -1)


def _attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: KeyedDropout, *,
                            scale: float | None, head_block: tuple[int, int],
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention written out, q [B, h, S, D] in position order, k, v [B, hkv, S, D], with keyed
    dropout on the probabilities: this rank's heads are block head_block[0] of h (= H / cp) heads of the
    H the tp rank holds, so their mask is the one the tp rank's (and one process's) heads draw."""
    index, heads = head_block
    h, seq = q.shape[1], q.shape[2]
    if k.shape[1] != h:  # GQA: each kv head serves h / hkv consecutive q heads
        k, v = (t.repeat_interleave(h // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril() if mask is None else mask
    wide = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(wide.to(torch.promote_types(wide.dtype, torch.float32)), dim=-1).type_as(q)
    positions = torch.arange(seq, device=q.device)
    dropped = dropout.at(probs, {1: (torch.arange(index * h, (index + 1) * h, device=q.device), heads),
                                 2: (positions, seq), 3: (positions, seq)})
    return dropped @ v
