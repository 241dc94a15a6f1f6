"""The GPT's elementwise pieces: RMSNorm (paratrain.nn.norms, which strategies know) and the rotary position
embedding."""

from __future__ import annotations

import torch

from paratrain.nn.norms import RMSNorm, upcast

__all__ = ["RMSNorm", "apply_rope", "rope_tables", "upcast"]


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
