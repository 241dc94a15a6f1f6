"""Cross-entropy that never holds the full float32 logits: the sum of per-token losses, by row chunks.

`F.cross_entropy(logits.float(), ...)` on bf16 logits[N, V] keeps three float32 [N, V] tensors
alive at some point: the upcast copy, the log-softmax saved for backward, and the gradient. For
GPT-2 at micro-batch 16 x 1024 tokens x 50304 that is 3.3 GB each. Per token n:

    loss_n = logsumexp_v(z_nv) - z_n,target          d loss_n / d z_nv = softmax(z_n)_v - [v = target]

so backward needs only the logits (already alive in their own dtype) and lse_n, one number per row.
Forward and backward walk the rows in chunks and upcast one chunk at a time, so the float32
temporaries are about chunk_rows x V (256 MiB by default) whatever N is:

    saved for backward    logits[N, Vp] (their own dtype, not copied), targets[N], lse[N] (float32)
    gradient              [N, Vp] in the logits' dtype; padding columns (>= vocab_size) get 0

Padding columns (a vocabulary padded to a multiple) are left out of the softmax by reading only the
first vocab_size columns of each chunk, never by slicing and copying the whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

CHUNK_BYTES = 256 * 2**20
"""Default size of one chunk's upcast logits: bounds every float32 temporary of forward and backward."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax runs in: at least float32 (bf16/fp16 go up, float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_rows(columns: int, dtype: torch.dtype) -> int:
    """Rows whose `columns` logits, upcast to compute_dtype(dtype), fill about CHUNK_BYTES (at least 1).
    GPT-2's 50304 columns in float32: 1334 rows."""
    return max(1, CHUNK_BYTES // (max(columns, 1) * compute_dtype(dtype).itemsize))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """logits[N, Vp], targets[N] -> sum over rows of loss_n (0 where ignored), a 0-dim tensor in
    compute_dtype(logits.dtype). Only columns [0, vocab_size) take part in the softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                ignore_index: int, chunk_rows: int) -> torch.Tensor:
        wide = compute_dtype(logits.dtype)
        real = logits[:, :vocab_size]  # a view: no copy, even when logits are padded
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)  # ignored rows read column 0 and are masked out
        # z_n,target: gathered in the logits' dtype (upcasting one value is exact), [N]. An index
        # outside [0, vocab_size) raises here, as F.cross_entropy does.
        target_logit = real.gather(1, safe.unsqueeze(1)).squeeze(1).to(wide)
        lse = torch.empty(logits.shape[0], dtype=wide, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            chunk = real[start:start + chunk_rows].to(wide)  # [rows, V]: the one float32 temporary
            torch.logsumexp(chunk, dim=-1, out=lse[start:start + chunk_rows])
        loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.vocab_size, ctx.chunk_rows = vocab_size, chunk_rows
        return loss_sum

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, safe, valid, lse = ctx.saved_tensors
        vocab_size, chunk_rows = ctx.vocab_size, ctx.chunk_rows
        # one scale per row: the incoming grad (a scalar: the output is a sum), 0 where ignored
        scale = torch.where(valid, grad.to(lse.dtype), 0.0)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_logits[:, vocab_size:] = 0  # padding columns: out of the softmax, no gradient
        for start in range(0, logits.shape[0], chunk_rows):
            end = start + chunk_rows
            # softmax = exp(z - lse): bf16 minus float32 promotes, so this is the upcast chunk
            # minus lse without a second temporary; [rows, V] in float32
            probs = torch.sub(logits[start:end, :vocab_size], lse[start:end].unsqueeze(1)).exp_()
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, safe[start:end]] -= valid[start:end].to(probs.dtype)
            # scaled and rounded to the logits' dtype as it is written: no second float32 pass
            torch.mul(probs, scale[start:end].unsqueeze(1), out=grad_logits[start:end, :vocab_size])
        return grad_logits, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int | None = None,
                          ignore_index: int = -100, chunk_rows: int | None = None) -> torch.Tensor:
    """Sum of per-token cross-entropies (0-dim, in at least float32) of logits[..., Vp] and targets[...].

    vocab_size: only columns [0, vocab_size) are in the softmax (default: all Vp); targets must be
        in that range or equal ignore_index, and ignored targets add 0.
    chunk_rows: rows upcast at a time (default: about 256 MiB of float32, see default_chunk_rows).

    Equal to F.cross_entropy(logits[..., :vocab_size].float(), targets, reduction="sum") up to
    float32 rounding, with no float32 [N, V] tensor saved or alive at once (module docstring).
    Logits may be any view (sliced, transposed); 2-D logits are never copied.
    """
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match: "
                         "logits must be [..., Vp] with targets [...] over the same leading dims")
    padded = logits.shape[-1]
    vocab_size = padded if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {padded}], the logits' last dim; "
                         "pass the real vocabulary size of a padded vocabulary, or None for all columns")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(vocab_size, logits.dtype)
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows is {chunk_rows}; it must be at least 1 (None picks ~256 MiB chunks)")
    if logits.dim() != 2:
        logits, targets = logits.reshape(-1, padded), targets.reshape(-1)  # a view when it can be
    return _ChunkedCrossEntropy.apply(logits, targets.long(), vocab_size, ignore_index, chunk_rows)


IGNORE_INDEX = -100
"""Targets with this id are not predicted (no loss, not counted)."""


class VocabOutput(nn.Module):
    """The end of the model: logits over the padded vocabulary -> the loss, or full logits to sample from.

    Padded rows (ids >= vocab_size) are never targets and are left out of the softmax, so padding
    changes nothing but the shapes. The loss is chunked_cross_entropy: logits[B, S, Vp] in their own
    dtype are all it saves for backward, never a float32 copy of them. Holds no parameters; tensor
    parallelism replaces it by one that reads vocabulary-split logits
    (paratrain.tensor_parallel.VocabParallelOutput).
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token cross-entropies, number of tokens) over targets that are not ignored.

        In float32 at least, by row chunks (this module): bf16 logits are never upcast
        whole, and backward keeps only the logits themselves and one number per token."""
        loss_sum = chunked_cross_entropy(logits, targets, vocab_size=self.vocab_size, ignore_index=IGNORE_INDEX)
        return loss_sum, (targets != IGNORE_INDEX).sum()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[..., vocab_size] over the real vocabulary."""
        return logits[..., : self.vocab_size]
