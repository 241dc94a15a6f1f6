"""Tensor-parallel layers, each built from the full (layout-free) dense layer by slicing it.

    ColumnParallelLinear   W[out, in] -> W[out/tp, in] on each rank
        x[B, S, in] (same on all ranks) @ W_r^T -> y_r[B, S, out/tp]; gather_output -> y[B, S, out]
    RowParallelLinear      W[out, in] -> W[out, in/tp] on each rank
        x_r[B, S, in/tp] @ W_r^T -> partial y[B, S, out], summed over tp (+ bias once, after the sum)
    VocabParallelEmbedding E[V, D] -> E[V/tp, D]: rank r looks up the ids in [r V/tp, (r+1) V/tp),
        zeros for the others, and the all-reduce assembles every row (sequence parallel: a
        reduce-scatter leaves each rank its slice of the sequence).

A column layer followed by a row layer needs one all-reduce in forward (after the row layer) and
one in backward (the column layer's input gradient): Shoeybi et al. 2019 (Megatron-LM), section 3.
With sequence parallelism the column input is all-gathered along the sequence and the row output
reduce-scattered along it instead (Korthikanti et al. 2022).

Slicing the full layer keeps the layout-free init: tp = 1 and tp = N start from the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm.collectives import all_gather_async
from paratrain.comm.regions import (
    all_gather_along,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_along,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
)
from paratrain.eager import eager
from paratrain.nn.kernels import LinearSplit, compute_dtype, dense_linear, kernel_of
from paratrain.topology.mesh import AxisGroup


def _slice(tensor: torch.Tensor, dim: int, group: AxisGroup, what: str) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % group.size:
        raise ValueError(f"{what}: dim {dim} of size {size} must be divisible by tp ({group.size})")
    part = size // group.size
    return tensor.detach().narrow(dim, group.index * part, part).clone()


def _parameter(full: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    """`value` (a slice or copy of the parameter `full`) as a parameter that trains, or stays frozen, as `full` does."""
    return nn.Parameter(value, requires_grad=full.requires_grad)


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather_seq(x) @ W^T + b that saves this rank's slice of x, not the gathered input.

    A plain gather-then-linear would keep the gathered [B, S, in] for the weight gradient, undoing
    what sequence parallelism saves; instead backward all-gathers x again (overlapped with the input
    gradient's matmul) and reduce-scatters the input gradient (Korthikanti et al. 2022, section 4.2.2).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: AxisGroup,
                dim: int) -> torch.Tensor:
        ctx.input_dtype = x.dtype
        x = x.to(compute_dtype(x))  # gather (and keep) the input in the compute dtype
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.dim, ctx.bias_dtype = group, dim, bias.dtype if bias is not None else None
        return F.linear(all_gather_along(x, group, dim), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        moved = x.movedim(ctx.dim, 0).contiguous()
        gathered = torch.empty((ctx.group.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        pending = all_gather_async(gathered, moved, ctx.group)  # in flight during the next matmul
        # backward runs outside autocast: compute in the output gradient's dtype, as forward did
        grad_input_full = grad @ weight.to(grad.dtype)
        pending.wait()
        full = gathered.movedim(0, ctx.dim).to(grad.dtype)
        grad_input = reduce_scatter_along(grad_input_full, ctx.group, ctx.dim).to(ctx.input_dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = (rows.t() @ full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_bias = rows.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return grad_input, grad_weight, grad_bias, None, None


@eager  # collectives run eagerly: torch.compile breaks its graph here
def _gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: AxisGroup,
                     dim: int) -> torch.Tensor:
    return _GatheredLinear.apply(x, weight, bias, group, dim)


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, group: AxisGroup, *, gather_output: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 1, reduce_input: bool = True) -> None:
        """reduce_input: sum the input's gradient over tp (Megatron's f); False after a PartialLinear, which sums it."""
        super().__init__()
        self.group, self.gather_output, self.reduce_input = group, gather_output, reduce_input
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = _parameter(full.weight, _slice(full.weight, 0, group, "column-parallel weight"))
        self.bias = (_parameter(full.bias, _slice(full.bias, 0, group, "column-parallel bias"))
                     if full.bias is not None else None)
        self.kernel = kernel_of(full)  # how the layer it slices multiplied (paratrain.nn.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.kernel is dense_linear:
            y = _gathered_linear(x, self.weight, self.bias, self.group, self.sequence_dim)
        else:
            if self.sequence_parallel:  # another kernel gathers the input itself (float8: cast first, half the bytes)
                split = LinearSplit(out=self.group, sequence=self.group, sequence_dim=self.sequence_dim)
            else:
                x = copy_to_tp_region(x, self.group) if self.reduce_input else x
                split = LinearSplit(out=self.group)
            y = self.kernel(x, self.weight, self.bias, split)  # [B, S, out/tp]
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class PartialLinear(nn.Module):
    """An nn.Linear kept whole on every tp rank whose output's gradient is partial there (it feeds this rank's heads
    only: DeepSeek's MLA down-projections): the input's gradient is summed over tp; the parameters' gradients are
    summed by the layout's hooks (TensorParallelLayout.partial_names)."""

    def __init__(self, full: nn.Linear, group: AxisGroup) -> None:
        super().__init__()
        self.group, self.weight, self.bias = group, full.weight, full.bias  # the same Parameters
        self.kernel = kernel_of(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(copy_to_tp_region(x, self.group), self.weight, self.bias, LinearSplit())


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, group: AxisGroup, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, sequence_dim: int = 1) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = _parameter(full.weight, _slice(full.weight, 1, group, "row-parallel weight"))
        # Replicated on every tp rank, added once after the sum. With sequence parallelism each rank
        # adds it to its slice of the sequence only, so its gradient is partial: whoever applies
        # sequence parallelism must sum such gradients over tp before the update (as for norms).
        self.bias = _parameter(full.bias, full.bias.detach().clone()) if full.bias is not None else None
        self.kernel = kernel_of(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        partial = self.kernel(x, self.weight, None, LinearSplit(inner=self.group))  # [B, S, out], this rank's share
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, group: AxisGroup, *, sequence_parallel: bool = False,
                 sequence_dim: int = 1) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = _parameter(full.weight, _slice(full.weight, 0, group, "vocab-parallel embedding"))
        self.vocab_start = group.index * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]
        pad = full.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        """The padding row (its gradient stays zero), when it lies in this rank's slice of the vocabulary."""
        scale = getattr(full, "embed_scale", None)  # a scaled embedding (Gemma's): rows times it, as it computes them
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        # outside ids read row 0 and are masked to zero (so is their gradient), padding row or not
        rows = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if hasattr(self, "embed_scale"):  # one rank holds each row: scaling before the sum changes no bit
            rows = rows * self.embed_scale.to(self.weight.dtype)
        if self.sequence_parallel:  # each rank keeps the sum for its slice of the sequence
            return reduce_scatter_to_sequence_region(rows, self.group, self.sequence_dim)
        return reduce_from_tp_region(rows, self.group)


def _block_slice(tensor: torch.Tensor, dim: int, blocks: int, group: AxisGroup, what: str) -> torch.Tensor:
    """This rank's slice of each of `blocks` equal blocks along `dim`, the slices back to back."""
    if blocks == 1:
        return _slice(tensor, dim, group, what)
    shape = tensor.shape
    if shape[dim] % blocks:
        raise ValueError(f"{what}: dim {dim} of size {shape[dim]} does not hold {blocks} equal blocks")
    viewed = tensor.detach().reshape(*shape[:dim], blocks, shape[dim] // blocks, *shape[dim + 1:])
    part = _slice(viewed, dim + 1, group, what)
    return part.reshape(*shape[:dim], shape[dim] // group.size, *shape[dim + 1:])


class ColumnParallelConv1D(nn.Module):
    """A Conv1D (GPT-2's layer: weight W[in, out], y = x @ W + b) split along its outputs: W[in, out/tp] on each
    rank, and with blocks > 1 (a fused q | k | v: 3) each block split alike, so rank r's outputs are
    [q_r | k_r | v_r]: whole heads of each, in the order the model splits them. Output stays split (feeds a row)."""

    def __init__(self, full: nn.Module, group: AxisGroup, *, blocks: int = 1) -> None:
        super().__init__()
        self.group = group
        self.weight = _parameter(full.weight, _block_slice(full.weight, 1, blocks, group, "column-parallel Conv1D"))
        self.bias = (_parameter(full.bias, _block_slice(full.bias, 0, blocks, group, "column-parallel Conv1D bias"))
                     if full.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = copy_to_tp_region(x, self.group) @ self.weight  # [B, S, out/tp]
        return y + self.bias if self.bias is not None else y


class RowParallelConv1D(nn.Module):
    """A Conv1D split along its inputs: W[in/tp, out], input already split, output summed over tp, bias added
    once after the sum (replicated)."""

    def __init__(self, full: nn.Module, group: AxisGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = _parameter(full.weight, _slice(full.weight, 0, group, "row-parallel Conv1D"))
        self.bias = _parameter(full.bias, full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp_region(x @ self.weight, self.group)  # [B, S, out], summed over tp
        return y + self.bias if self.bias is not None else y
