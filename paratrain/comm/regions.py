"""Autograd "regions" of tensor parallelism, named by their forward action (Megatron-LM's vocabulary).

Each is an identity, a collective or a split in forward, and its conjugate in backward:

    copy_to_tp_region(x)          fwd: identity                 bwd: all-reduce the gradient
    reduce_from_tp_region(x)      fwd: all-reduce               bwd: identity
    gather_from_tp_region(x)      fwd: all-gather on the last dim   bwd: keep this rank's slice
    scatter_to_tp_region(x)       fwd: keep this rank's slice of the last dim   bwd: all-gather
    gather_from_sequence_region(x, dim)       fwd: all-gather along dim   bwd: reduce-scatter
    reduce_scatter_to_sequence_region(x, dim) fwd: reduce-scatter along dim   bwd: all-gather
    sum_in_region(x)              fwd: all-reduce               bwd: all-reduce (a sum every rank goes on
                                  to use: the 2d grid's norm statistics over a row's blocks of the width)
    gather_along_region(x, dim)   fwd: all-gather along dim     bwd: keep this rank's slice (what every rank
                                  goes on to use alike: a grid's logits gathered whole for a loss)

Why they pair up: a column-parallel linear needs the same input on every tp rank (copy-to: forward
nothing, but the input's gradient is the sum of every rank's partial), a row-parallel linear
produces partial sums (reduce-from: forward sums, backward every rank already holds the gradient).
Sequence parallelism replaces the all-reduce by reduce-scatter + all-gather along the sequence
(Korthikanti et al. 2022), so norms and dropout between the blocks run on 1/tp of the tokens.

The group is always passed in; slices are in group-rank order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paratrain.comm.collectives import all_gather_async, all_reduce, reduce_scatter_async
from paratrain.eager import eager
from paratrain.topology.mesh import AxisGroup


def _split(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(f"dim {dim} of size {size} does not split evenly over {group.describe()}")
    part = x.narrow(dim, group.index * (size // group.size), size // group.size)
    # a copy even where the slice is contiguous (along dim 0): a view would keep the whole tensor's storage alive
    return part.clone(memory_format=torch.contiguous_format) if group.size > 1 else part


def all_gather_along(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    """Every group rank's x concatenated along dim, in group order (no autograd)."""
    # gather along dim 0 of a [tp, ...] buffer, then lay the pieces out along `dim`
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_async(out, moved, group).wait()
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, group: AxisGroup, dim: int, *,
                         primitive: str | None = None) -> torch.Tensor:
    """This rank's slice along dim of the sum over the group of x (no autograd).

    primitive: 'reduce_scatter', or 'all_reduce' (then slice); None: all-reduce for CPU tensors
    (gloo's all-reduce beats its reduce-scatter, docs/sharding.md), reduce-scatter otherwise."""
    if (primitive or ("all_reduce" if x.device.type == "cpu" else "reduce_scatter")) == "all_reduce":
        return _split(_sum(x, group, dim), group, dim)
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % group.size:
        raise ValueError(f"dim {dim} of size {moved.shape[0]} does not split evenly over {group.describe()}")
    out = torch.empty((moved.shape[0] // group.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_async(out, moved, group).wait()
    return out.movedim(0, dim).contiguous()


def _identity(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    return x.view_as(x)


def _sum(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place into a tensor autograd may still need
    all_reduce(out, group)
    return out


_Action = Callable[[torch.Tensor, AxisGroup, int], torch.Tensor]


class _Region(torch.autograd.Function):
    """A region is a pair of conjugate actions: `forward` on the way in, `backward` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int, forward: _Action,
                backward: _Action) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.backward_action = group, dim, backward
        return forward(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.backward_action(grad, ctx.group, ctx.dim), None, None, None, None


@eager  # collectives run eagerly: torch.compile breaks its graph here
def _region(x: torch.Tensor, group: AxisGroup, dim: int, forward: _Action, backward: _Action) -> torch.Tensor:
    return _Region.apply(x, group, dim, forward, backward)


def copy_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _region(x, group, -1, _identity, _sum)


def reduce_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _region(x, group, -1, _sum, _identity)


def gather_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _region(x, group, x.dim() - 1, all_gather_along, _split)


def scatter_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _region(x, group, x.dim() - 1, _split, all_gather_along)


def gather_from_sequence_region(x: torch.Tensor, group: AxisGroup, dim: int = 1) -> torch.Tensor:
    return _region(x, group, dim, all_gather_along, reduce_scatter_along)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: AxisGroup, dim: int = 1) -> torch.Tensor:
    return _region(x, group, dim, reduce_scatter_along, all_gather_along)


def sum_in_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _region(x, group, -1, _sum, _sum)


def gather_along_region(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    return _region(x, group, dim, all_gather_along, _split)


__all__ = [
    "all_gather_along", "reduce_scatter_along", "copy_to_tp_region", "gather_from_sequence_region", "gather_from_tp_region", "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region", "scatter_to_tp_region", "sum_in_region",
    "gather_along_region",
]
