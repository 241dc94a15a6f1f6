"""RMSNorm, computed in float32 at least, keeping only x and 1 / rms for backward: the GPT's norm, which strategies
know by type (the 2d / 3d grids cut it along the width: paratrain.tensor_parallel.grid_layers)."""

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
