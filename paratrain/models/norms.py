"""The GPT's elementwise pieces: RMSNorm (computed in float32 at least) and the rotary position embedding."""

from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32: bf16/fp16 go up, float32/float64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """x / rms(x) * weight, normalised in float32 at least (the mean of squares loses too much in bf16), keeping
    for backward only x in its own dtype and 1 / rms (float32, one per row): the float32 copy of x and the
    normalised x are recomputed there. Autograd on the plain ops would keep both (in 16-bit storage 3 bytes more
    per element than x itself); its gradients are the same ops in the same order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        wide = upcast(x)
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (wide * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        wide = upcast(x)
        normed = (wide * rstd).type_as(x)
        grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_normed = (grad * weight).to(wide.dtype)  # through type_as: back to float32
        grad_rstd = (grad_normed * wide).sum(-1, keepdim=True)
        grad_mean = grad_rstd * -0.5 * rstd.pow(3)  # rstd = (mean(wide^2) + eps)^(-1/2)
        grad_wide = grad_normed * rstd + grad_mean * (2.0 / x.shape[-1]) * wide
        return grad_wide.to(x.dtype), grad_weight, None


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim / 2] (Su et al. 2021, RoFormer, eq. 34)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x[B, H, S, hd] by position-dependent angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # [S, hd/2] broadcast over B and H, or [B, 1, S, hd/2] over H
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
