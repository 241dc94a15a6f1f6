"""Cross-entropy over logits split along the vocabulary, without ever gathering them.

Rank r holds logits[N, V/tp] for the vocabulary slice [r V/tp, (r+1) V/tp). Per token n:

    loss_n = log(sum_v exp(z_nv - m_n)) + m_n - z_n,target      m_n = max_v z_nv

Three all-reduces of [N] vectors (max, sum of exponentials, the target logit, which exactly one rank
holds) replace an all-gather of [N, V]. The gradient is softmax - onehot(target), each rank writing
its own slice (Megatron-LM, tensor_parallel/cross_entropy.py, in our own words).

Like paratrain.nn.loss, the rows are walked in chunks upcast one at a time: backward keeps the
logits in their own dtype and the [N] maxima and sums, and recomputes the softmax chunk by chunk,
instead of keeping a float32 softmax[N, V/tp].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import all_reduce
from paratrain.comm.regions import gather_from_tp_region
from paratrain.nn.loss import compute_dtype, default_chunk_rows
from paratrain.topology.mesh import AxisGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses [N] from logits[N, V/tp] (any float dtype), by row chunks: the float32
    temporaries are chunk_rows x V/tp, and backward keeps the logits in their own dtype plus [N]
    vectors (the maxima and sums of exponentials in at least float32, target indices and masks),
    never the softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                ignore_index: int, vocab_size: int | None, chunk_rows: int | None) -> torch.Tensor:
        wide = compute_dtype(logits.dtype)
        rows, part = logits.shape
        start = group.index * part
        # columns of this slice in the softmax: padding (ids >= vocab_size) is left out by reading
        # only the first `real` columns of each chunk, none at all on a slice that is all padding
        real = part if vocab_size is None else min(max(vocab_size - start, 0), part)
        chunk_rows = chunk_rows or default_chunk_rows(part, logits.dtype)
        if real:  # the max is exact in any dtype: no upcast needed
            maxima = logits[:, :real].amax(dim=-1).to(wide)
        else:
            maxima = torch.full((rows,), float("-inf"), dtype=wide, device=logits.device)
        all_reduce(maxima, group, op=dist.ReduceOp.MAX)
        sum_exp = torch.zeros(rows, dtype=wide, device=logits.device)
        for first in range(0, rows if real else 0, chunk_rows):
            last = first + chunk_rows
            # bf16 minus float32 promotes: the upcast chunk, shifted, is the one [chunk, V/tp] temporary
            shifted = torch.sub(logits[first:last, :real], maxima[first:last].unsqueeze(-1))
            torch.sum(shifted.exp_(), dim=-1, out=sum_exp[first:last])
        all_reduce(sum_exp, group)
        local = targets - start
        mine = (local >= 0) & (local < part)  # exactly one rank holds each target
        local = local.clamp(0, part - 1)
        # z_target - m, [N]; a target in the padding gets -inf (an infinite loss), as a column out
        # of the softmax must
        target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(wide) - maxima
        target_logit = torch.where(local < real, target_logit, float("-inf"))
        target_logit = torch.where(mine, target_logit, 0.0)
        all_reduce(target_logit, group)
        ignored = targets == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, maxima, sum_exp, local, mine & ~ignored & (local < real), ignored)
        ctx.real, ctx.chunk_rows = real, chunk_rows
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, maxima, sum_exp, local, hit, ignored = ctx.saved_tensors
        real, chunk_rows = ctx.real, ctx.chunk_rows
        # d loss_n / d z_nv = (softmax_nv - [v = target]) * grad_n, 0 on ignored rows
        scale = grad.to(maxima.dtype).masked_fill(ignored, 0.0)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_logits[:, real:] = 0  # padding columns: out of the softmax, no gradient
        for first in range(0, logits.shape[0] if real else 0, chunk_rows):
            last = first + chunk_rows
            probs = torch.sub(logits[first:last, :real], maxima[first:last].unsqueeze(-1)).exp_()
            probs.div_(sum_exp[first:last].unsqueeze(-1))  # softmax over the whole vocabulary, [chunk, real]
            index = torch.arange(probs.shape[0], device=probs.device)
            probs[index, local[first:last].clamp(max=real - 1)] -= hit[first:last].to(probs.dtype)
            # scaled and rounded to the logits' dtype as it is written: no second float32 pass
            torch.mul(probs, scale[first:last].unsqueeze(-1), out=grad_logits[first:last, :real])
        return grad_logits, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                                 *, ignore_index: int = -100, vocab_size: int | None = None,
                                 chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token losses [N] (0 where ignored) from logits[N, V/tp] and targets[N] in the full vocabulary.
    vocab_size: columns at or beyond it (padding of the vocabulary) are left out of the softmax.
    chunk_rows: rows upcast to float32 at a time (default: about 64 MiB, see
    paratrain.nn.loss.default_chunk_rows); the three all-reduces are per call, not per chunk."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows is {chunk_rows}; it must be at least 1 (None picks ~64 MiB chunks)")
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index, vocab_size, chunk_rows)


class VocabParallelOutput(nn.Module):
    """paratrain.nn.loss.VocabOutput for logits split along the (padded) vocabulary over tp."""

    def __init__(self, vocab_size: int, group: AxisGroup, *, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.group, self.ignore_index = vocab_size, group, ignore_index

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token cross-entropies, number of tokens), the same on every tp rank."""
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                              self.group, ignore_index=self.ignore_index,
                                              vocab_size=self.vocab_size)
        return losses.sum(), (targets != self.ignore_index).sum()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[..., vocab_size]: every rank's slice gathered (for sampling), padding dropped."""
        return gather_from_tp_region(logits, self.group)[..., : self.vocab_size]
