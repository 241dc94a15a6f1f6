"""Autograd "regions" of tensor parallelism, named by their forward action (Megatron-LM's vocabulary).

Each is an identity, a collective or a split in forward, and its conjugate in backward:

    copy_to_tp_region(x)          fwd: identity                 bwd: all-reduce the gradient
    reduce_from_tp_region(x)      fwd: all-reduce               bwd: identity
    gather_from_tp_region(x)      fwd: all-gather on the last dim   bwd: keep this rank's slice
    scatter_to_tp_region(x)       fwd: keep this rank's slice of the last dim   bwd: all-gather
    gather_from_sequence_region(x, dim)       fwd: all-gather along dim   bwd: reduce-scatter
    reduce_scatter_to_sequence_region(x, dim) fwd: reduce-scatter along dim   bwd: all-gather

Why they pair up: a column-parallel linear needs the same input on every tp rank (copy-to: forward
nothing, but the input's gradient is the sum of every rank's partial), a row-parallel linear
produces partial sums (reduce-from: forward sums, backward every rank already holds the gradient).
Sequence parallelism replaces the all-reduce by reduce-scatter + all-gather along the sequence
(Korthikanti et al. 2022), so norms and dropout between the blocks run on 1/tp of the tokens.

The group is always passed in; slices are in group-rank order.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm.collectives import all_gather_async, all_reduce
from paratrain.topology.mesh import AxisGroup


def _split(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % group.size:
        raise ValueError(f"dim {dim} of size {size} does not split evenly over {group.describe()}")
    return x.narrow(dim, group.index * (size // group.size), size // group.size).contiguous()


def _all_gather(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    # gather along dim 0 of a [tp, ...] buffer, then lay the pieces out along `dim`
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_async(out, moved, group).wait()
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
    summed = x.contiguous().clone()
    all_reduce(summed, group)  # gloo: an all-reduce then a slice beats its reduce-scatter (docs/sharding.md)
    return _split(summed, group, dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.group, ctx.dim), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def copy_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _CopyTo.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _ReduceFrom.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _GatherFrom.apply(x, group, x.dim() - 1)


def scatter_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return _ScatterTo.apply(x, group, x.dim() - 1)


def gather_from_sequence_region(x: torch.Tensor, group: AxisGroup, dim: int = 1) -> torch.Tensor:
    return _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: AxisGroup, dim: int = 1) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, group, dim)


__all__ = [
    "copy_to_tp_region", "gather_from_sequence_region", "gather_from_tp_region", "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region", "scatter_to_tp_region",
]
