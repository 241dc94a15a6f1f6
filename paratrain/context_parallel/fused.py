"""Ring attention's blocks on the fused attention kernel: each block cut into runs of consecutive positions.

A rank's tokens under the load-balanced split are two runs of consecutive positions (its two chunks), so
a block of (this rank's queries, one rank's keys) is a few pairs of runs, and under a causal mask every
pair is one of three kinds, each one kernel call or none:

    keys all before the queries   every pair visible: the kernel without a mask
    the same positions            the causal triangle: the kernel with is_causal (top-left aligned)
    keys all after the queries    nothing visible: skipped

(two runs that overlap otherwise are first cut at each other's ends into such pairs; pieces of one query
run whose keys lie side by side in the block are one call). Packed documents the same in every row (a
micro-batch of one row, as long contexts train) cut the runs at each document's start, and pairs of runs
in different documents are skipped: only pairs inside documents are computed, as a varlen kernel does. The kernel is aten's flash attention for the
CPU (_scaled_dot_product_flash_attention_for_cpu: float64, float32, bf16; the kernel behind
F.scaled_dot_product_attention on the CPU), which returns its output with the log-sum-exp, so pieces
merge exactly as blocks do (paratrain.context_parallel.block.merge_partials), and whose backward, given
the merged output and log-sum-exp of every block, returns the piece's exact share of dq, dk and dv
(flash attention's recomputation). No [Sq, Sk] score tensor is held: O(S) memory per block, as SDPA's,
where the plain block kernel holds the block's scores.

GQA: the kernel reads kv head h // (H / Hkv) for q head h itself. On CUDA ring attention keeps the plain
block kernel (a fused CUDA path, aten's flash kernel for 16-bit inputs, is not built: no GPU has run it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from paratrain.context_parallel.block import merge_partials

MAX_PIECES = 256
"""More pieces than this in a block (positions scattered into many short runs): the plain kernel instead."""


@dataclass(frozen=True)
class Piece:
    """Queries [q0, q0 + nq) of this rank against keys [k0, k0 + nk) of the block (local indices), every
    pair visible (causal False) or the same positions (causal True)."""

    q0: int
    nq: int
    k0: int
    nk: int
    causal: bool


def fused_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fused_block_forward / backward run on this device and dtype (the CPU's flash kernel)."""
    return device.type in ("cpu", "meta") and dtype in (torch.float64, torch.float32, torch.bfloat16)


def plan_pieces(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool,
                starts: tuple[int, ...] = ()) -> tuple[Piece, ...] | None:
    """The pieces of the block of queries at q_pos [Sq] and keys at k_pos [Sk] (host tensors of distinct
    positions); () when no query sees a key; None when the positions make more than MAX_PIECES pieces.
    starts: where packed documents begin in the window (ascending; the same in every row of the batch): runs
    are cut there and a query meets only its own document's keys, so only pairs inside documents are computed."""
    nq, nk = q_pos.numel(), k_pos.numel()
    if not causal:
        return (Piece(0, nq, 0, nk, False),)
    pieces = []
    by_document: dict[int, list[tuple[int, int, int]]] = {}  # runs of keys by their document (runs are cut at starts)
    for run in _runs(k_pos.tolist(), starts):
        by_document.setdefault(bisect.bisect_right(starts, run[1]), []).append(run)
    for q_at, q_first, q_len in _runs(q_pos.tolist(), starts):
        for k_at, k_first, k_len in by_document.get(bisect.bisect_right(starts, q_first), []):  # its own document's
            cuts = sorted({q_first, q_first + q_len, k_first, k_first + k_len})
            spans = list(zip(cuts, cuts[1:]))
            for qa, qb in (s for s in spans if q_first <= s[0] and s[1] <= q_first + q_len):
                for ka, kb in (s for s in spans if k_first <= s[0] and s[1] <= k_first + k_len):
                    if ka >= qb:  # every key after every query: masked
                        continue
                    pieces.append(Piece(q_at + qa - q_first, qb - qa, k_at + ka - k_first, kb - ka, causal=kb > qa))
            if len(pieces) > MAX_PIECES:
                return None
    return _joined(pieces)


def fused_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple[Piece, ...], *,
                        scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge this block's pieces into the running (out [B, H, Sq, D], lse [B, H, Sq]) in place."""
    for p in pieces:
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.narrow(2, p.q0, p.nq), k.narrow(2, p.k0, p.nk), v.narrow(2, p.k0, p.nk), 0.0, p.causal, scale=scale)
        merged_out, merged_lse = merge_partials(out.narrow(2, p.q0, p.nq), lse.narrow(2, p.q0, p.nq),
                                                o.to(out.dtype), l.to(lse.dtype))
        out.narrow(2, p.q0, p.nq).copy_(merged_out)
        lse.narrow(2, p.q0, p.nq).copy_(merged_lse)


def fused_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple[Piece, ...],
                         whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, scale: float,
                         dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Add this block's share of the whole attention's gradients: dq [B, H, Sq, D] and dkv [2, B, Hkv, Sk, D]
    in place, from whole = (out, lse, grad_out): the results merged over every block and their incoming gradient."""
    out, lse, grad_out = whole
    for p in pieces:
        rows, cols = (2, p.q0, p.nq), (2, p.k0, p.nk)
        dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.narrow(*rows), q.narrow(*rows), k.narrow(*cols), v.narrow(*cols), out.narrow(*rows),
            lse.narrow(*rows), 0.0, p.causal, scale=scale)
        dq.narrow(*rows).add_(dq_p)
        dkv[0].narrow(*cols).add_(dk_p)
        dkv[1].narrow(*cols).add_(dv_p)


def _runs(positions: list[int], starts: tuple[int, ...] = ()) -> list[tuple[int, int, int]]:
    """(local index, first position, length) of each maximal run of consecutive increasing positions (cut where a
    document starts)."""
    runs: list[tuple[int, int, int]] = []
    cut = set(starts)
    for i, p in enumerate(positions):
        if runs and p == runs[-1][1] + runs[-1][2] and p not in cut:
            at, first, length = runs[-1]
            runs[-1] = (at, first, length + 1)
        else:
            runs.append((i, p, 1))
    return runs


def _joined(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Unmasked pieces of the same queries whose keys lie side by side in the block, as one."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.q0, p.nq, p.causal, p.k0)):
        last = out[-1] if out else None
        if (last is not None and not p.causal and not last.causal and (last.q0, last.nq) == (p.q0, p.nq)
                and last.k0 + last.nk == p.k0):
            out[-1] = Piece(p.q0, p.nq, last.k0, last.nk + p.nk, False)
        else:
            out.append(p)
    return tuple(out)
