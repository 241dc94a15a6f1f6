"""Cross-entropy over logits split along the vocabulary, without ever gathering them.

Rank r holds logits[N, V/tp] for the vocabulary slice [r V/tp, (r+1) V/tp). Per token n:

    loss_n = log(sum_v exp(z_nv - m_n)) + m_n - z_n,target      m_n = max_v z_nv

Three all-reduces of [N] vectors (max, sum of exponentials, the target logit, which exactly one rank
holds) replace an all-gather of [N, V]. The gradient is softmax - onehot(target), each rank writing
its own slice (Megatron-LM, tensor_parallel/cross_entropy.py, in our own words).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import all_reduce
from paratrain.comm.regions import gather_from_tp_region
from paratrain.topology.mesh import AxisGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                ignore_index: int, vocab_size: int | None) -> torch.Tensor:
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        part = logits.shape[-1]
        start = group.index * part
        if vocab_size is not None and start + part > vocab_size:  # padding rows: out of the softmax
            logits = logits.clone()
            logits[..., max(vocab_size - start, 0):] = float("-inf")
        maxima = logits.max(dim=-1).values
        all_reduce(maxima, group, op=dist.ReduceOp.MAX)
        shifted = logits - maxima.unsqueeze(-1)  # [N, V/tp]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        mine = (targets >= start) & (targets < start + part)
        local = (targets - start).clamp(0, part - 1)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        all_reduce(target_logit, group)
        loss = sum_exp.log() - target_logit
        ignored = targets == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local, mine, ignored = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        grad_logits = grad_logits.masked_fill(ignored.unsqueeze(-1), 0.0)
        return grad_logits * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: AxisGroup,
                                 *, ignore_index: int = -100, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token losses [N] (0 where ignored) from logits[N, V/tp] and targets[N] in the full vocabulary.
    vocab_size: columns at or beyond it (padding of the vocabulary) are left out of the softmax."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, ignore_index, vocab_size)


class VocabParallelOutput(nn.Module):
    """paratrain.models.gpt.VocabOutput for logits split along the (padded) vocabulary over tp."""

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
