"""The global gradient norm, counting every logical parameter exactly once."""

from __future__ import annotations

import torch

from paratrain.comm.collectives import all_reduce
from paratrain.topology.mesh import AxisGroup


def global_grad_norm(owned: list[torch.Tensor], *, sum_over: tuple[AxisGroup, ...] = ()) -> torch.Tensor:
    """L2 norm of all gradients of the model, as float32.

    `owned` are the gradient pieces this rank is the single owner of; the groups in `sum_over` are
    the axes across which different ranks own different pieces (shards). Replicated pieces must be
    in `owned` on exactly one rank of those groups, or on all ranks with sum_over empty: then each
    logical parameter is counted once (not once per replica).
    """
    if owned:
        # in at least float32 (never down: float64 gradients keep a float64 norm)
        wide = torch.promote_types(owned[0].dtype, torch.float32)
        squares = torch.stack([torch.linalg.vector_norm(t, dtype=wide) ** 2 for t in owned]).sum()
    else:
        squares = torch.zeros(())
    for group in sum_over:
        all_reduce(squares, group)
    return squares.sqrt()


@torch.no_grad()
def clip_by_norm_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads so their global norm is at most max_norm (as torch.nn.utils.clip_grad_norm_)."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
