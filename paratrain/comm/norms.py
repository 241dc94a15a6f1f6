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
        if part.grads:  # one foreach kernel per part, not one norm per tensor
            squares = torch.stack(torch._foreach_norm(part.grads, dtype=wide)).pow(2).sum()
        else:
            squares = torch.zeros((), dtype=wide, device=device)
        for group in part.sum_over:
            all_reduce(squares, group)
        total = total + squares
    return total.sqrt()


@torch.no_grad()
def divide_and_clip_(grads: list[torch.Tensor], divisor: torch.Tensor, norm: torch.Tensor, max_norm: float) -> None:
    """grads /= divisor, then scaled so that their global norm (`norm`, of the divided gradients) is at
    most max_norm (as torch.nn.utils.clip_grad_norm_; 0: no clipping), in one pass over the gradients:
    one multiplication by (1 / divisor) x min(1, max_norm / (norm + 1e-6)), in at least float32."""
    factor = 1.0 / divisor.double()
    if max_norm > 0:
        factor = factor * torch.clamp(max_norm / (norm.double() + 1e-6), max=1.0)
    for (device, dtype), group in by_device_and_dtype(grads).items():
        torch._foreach_mul_(group, factor.to(device=device, dtype=torch.promote_types(dtype, torch.float32)))


def by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Tensors grouped so that each group can go through one foreach kernel."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups
