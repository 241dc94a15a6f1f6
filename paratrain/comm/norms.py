"""The global gradient norm, counting every logical parameter exactly once."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from paratrain.comm.collectives import all_reduce
from paratrain.topology.mesh import AxisGroup


class NormPart(NamedTuple):
    """Gradient pieces and the axes across which ranks hold *different* pieces of them.

    A tensor-parallel weight's slice sums over tp; a ZeRO shard sums over the shard group; a
    replicated piece (every rank of the axis holds the same one) must not sum over that axis.
    """

    grads: list[torch.Tensor]
    sum_over: tuple[AxisGroup, ...] = ()


def global_grad_norm(parts: Sequence[NormPart]) -> torch.Tensor:
    """L2 norm of all gradients of the model, in at least float32 (float64 gradients keep float64).

    Each part's sum of squares is summed over its own axes, then the parts are added: so every
    logical parameter is counted once, not once per replica.
    """
    tensors = [g for part in parts for g in part.grads]
    wide = torch.promote_types(tensors[0].dtype, torch.float32) if tensors else torch.float32
    device = tensors[0].device if tensors else None
    total = torch.zeros((), dtype=wide, device=device)
    for part in parts:
        if part.grads:
            squares = torch.stack([torch.linalg.vector_norm(t, dtype=wide) ** 2 for t in part.grads]).sum()
        else:
            squares = torch.zeros((), dtype=wide, device=device)
        for group in part.sum_over:
            all_reduce(squares, group)
        total = total + squares
    return total.sqrt()


@torch.no_grad()
def clip_by_norm_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale grads so their global norm is at most max_norm (as torch.nn.utils.clip_grad_norm_)."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
