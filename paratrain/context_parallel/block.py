"""The block kernel of ring attention: attention of some queries over one block of keys, returning the
partial output with its log-sum-exp so that blocks can be merged exactly; the merge; and the block's
backward given the merged result (flash-attention's recomputation).

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, g = H / Hkv: GQA, q head h reads kv
head h // g, as F.scaled_dot_product_attention(enable_gqa=True) does), Sq queries, Sk keys, D head dim.

    s = scale q k^T, masked to -inf where causal and key position > query position   [B, H, Sq, Sk]
        (and, for packed documents, where the key lies before the query's document: query position - key
        position > q_doc, the query's position in its document; paratrain.nn.documents)
    lse = logsumexp_k s                                                               [B, H, Sq]
    out = exp(s - lse) v                                                              [B, H, Sq, D]

A row whose every key is masked has lse = -inf and out = 0: it takes weight exp(-inf) = 0 in the merge,
never NaN. The q heads of a kv group are folded into rows ([B, Hkv, g Sq, D]), so k and v are used as
they are (no repeat) and dk, dv come out summed over the group by the matmul itself.

Attention dropout (`drop`, keyed by position: paratrain.nn.dropout) multiplies the block's probabilities
by its mask Z (keep / (1 - p)) after the softmax's normalisation, as one process does:
out = (exp(s - lse) * Z) v. The merge is unchanged (lse is of the undropped scores), and so is the
backward's delta: rowsum(dO * O) = sum_k P Z (dO . v_k) = sum_k P dP with dP = (dO v^T) * Z.

Plain matmul and softmax in the input dtype: float64 on CPU is exact to rounding. It holds the block's
[B, H, Sq, Sk] scores while it runs; ring attention uses it for what the fused kernels cannot draw
(keyed dropout) and otherwise cuts each block into runs of consecutive positions that the fused kernel
computes without them (paratrain.context_parallel.fused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


Drop = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""drop(probabilities [B, H, Sq, Sk], q_pos [Sq], k_pos [Sk]) -> them times the block's dropout mask."""


@dataclass(frozen=True)
class Scoring:
    """How a block's scores are formed: s = scale q k^T, masked where causal and key position > query
    position; and drop: its probabilities' dropout (keyed by position), None without."""

    causal: bool
    scale: float
    drop: Drop | None = None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scoring: Scoring, q_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Sq, D], k, v [B, Hkv, Sk, D], q_pos [Sq], k_pos [Sk] (global positions, LongTensor), q_doc
    [B, Sq] (packed documents: each query's position in its document, or None)
    -> (out [B, H, Sq, D], lse [B, H, Sq]). Plain differentiable torch ops, so autograd (and gradcheck)
    can also differentiate it; ring attention uses block_attention_backward instead."""
    scores = _scores(q, k, q_pos, k_pos, scoring, q_doc)  # [B, Hkv, g Sq, Sk]
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, g Sq]; -inf where every key is masked
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))  # 0 on fully masked rows
    out = _dropped(probs, q.shape[1], q_pos, k_pos, scoring.drop) @ v  # [B, Hkv, g Sq, D]
    return _unfold(out, q.shape[1]), _unfold(lse.unsqueeze(-1), q.shape[1]).squeeze(-1)


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                             k_pos: torch.Tensor, whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                             scoring: Scoring,
                             q_doc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients of the *whole* attention, recomputed from its inputs.

    whole = (out [B, H, Sq, D], lse [B, H, Sq], grad_out [B, H, Sq, D]): the results merged over every block (not
    this block's) and their incoming gradient. With P = exp(s - lse) this block's exact
    probabilities in the whole softmax:

        dv = P^T dO        dP = dO v^T        dS = P * (dP - rowsum(dO * O))
        dq = scale dS k    dk = scale dS^T q

    (with dropout's mask Z: dv = (P * Z)^T dO and dP = (dO v^T) * Z, the mask drawn again by scoring.drop)

    -> (dq [B, H, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, D]); dq summed over the blocks and dk, dv
    over the query rows of every rank give the whole attention's gradients.
    """
    h, (out, lse, grad_out), scale, drop = q.shape[1], whole, scoring.scale, scoring.drop
    scores = _scores(q, k, q_pos, k_pos, scoring, q_doc)  # [B, Hkv, g Sq, Sk]
    p = torch.exp(scores - _finite(_fold(lse.unsqueeze(-1), k.shape[1]).squeeze(-1)).unsqueeze(-1))
    d_o = _fold(grad_out, k.shape[1])  # [B, Hkv, g Sq, D]
    delta = (d_o * _fold(out, k.shape[1])).sum(dim=-1, keepdim=True)  # rowsum(dO * O) [B, Hkv, g Sq, 1]
    d_p = _dropped(d_o @ v.transpose(-1, -2), h, q_pos, k_pos, drop)  # [B, Hkv, g Sq, Sk]
    d_s = p * (d_p - delta)
    dq = _unfold(d_s @ k, h) * scale
    dk = d_s.transpose(-1, -2) @ _fold(q, k.shape[1]) * scale  # [B, Hkv, Sk, D]
    dv = _dropped(p, h, q_pos, k_pos, drop).transpose(-1, -2) @ d_o
    return dq, dk, dv


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of two blocks from each block's (out [..., S, D], lse [..., S]):

        lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    exact, since exp(lse_x - lse) is the share of the softmax's mass that block x holds. Rows masked in
    both blocks stay lse = -inf, out = 0 (weights 0, not NaN)."""
    lse = torch.logaddexp(lse_a, lse_b)  # -inf when both are -inf
    safe = _finite(lse)
    weight_a, weight_b = torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scoring: Scoring,
            q_doc: torch.Tensor | None = None) -> torch.Tensor:
    """scale q k^T with the causal mask applied: [B, Hkv, g Sq, Sk], row i g-major (i = j Sq + s: q head
    kv_head * g + j, query s); with q_doc [B, Sq], keys before each query's document masked too."""
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    scores = _fold(q, hkv) @ k.transpose(-1, -2) * scoring.scale
    if scoring.causal:
        masked = k_pos.unsqueeze(0) > q_pos.repeat(g).unsqueeze(1)  # [g Sq, Sk]
        scores = scores.masked_fill(masked, float("-inf"))
    if q_doc is not None:  # key j before query i's document: i - j > q_doc[i]   [B, 1, g Sq, Sk]
        back = q_pos.repeat(g).unsqueeze(1) - k_pos.unsqueeze(0)  # [g Sq, Sk]
        scores = scores.masked_fill((back.unsqueeze(0) > q_doc.repeat(1, g).unsqueeze(-1)).unsqueeze(1), float("-inf"))
    return scores


def _dropped(x: torch.Tensor, h: int, q_pos: torch.Tensor, k_pos: torch.Tensor, drop: Drop | None) -> torch.Tensor:
    """x [B, Hkv, g Sq, Sk] (folded) times the dropout mask of the [B, H, Sq, Sk] block it folds."""
    if drop is None:
        return x
    return _fold(drop(_unfold(x, h), q_pos, k_pos), x.shape[1])


def _fold(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, S, E] -> [B, Hkv, (H / Hkv) S, E]: the q heads of each kv group stacked as rows."""
    b, h, s, e = x.shape
    return x.reshape(b, hkv, (h // hkv) * s, e)


def _unfold(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B, Hkv, g S, E] -> [B, H, S, E], the inverse of _fold."""
    b, _, rows, e = x.shape
    return x.reshape(b, h, rows * x.shape[1] // h, e)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no key seen) replaced by 0, so exp(s - lse) = exp(-inf) = 0 there instead of NaN."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
