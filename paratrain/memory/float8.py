"""Float8 linears (precision 'fp8') whose scales are those of the logical tensors, in every layout.

A float8 linear quantises its operands before each of its three matmuls (torch._scaled_mm, float32 accumulation):

    forward       y  = x W^T      x [T, in] and W [out, in] in e4m3
    input grad    dx = g W        g [T, out] in the recipe's gradient format, W again
    weight grad   dW = g^T x      both along the tokens

Each operand is divided by a scale taken from its largest magnitude (amax). Where a layout splits a tensor (a
column-parallel weight's rows over tp, a row-parallel weight's columns and its input's features over tp, the tokens
over cp) the amax of the slice a rank holds is not the tensor's, and a scale taken from it would make tp 2 train
another model than tp 1 (pytorch/ao#1327). So every amax is reduced (max) over exactly the groups that split the
dimensions it runs over, and the scale is the logical tensor's. Two recipes (as torchao names them):

    tensorwise   one scale per tensor; e4m3 forward, e5m2 gradients (Transformer Engine's HYBRID format)
    rowwise      one scale per row of each matmul operand along its reduced dimension; e4m3 everywhere

Scales are powers of two (the largest s with amax * s <= the format's max), computed from the amax's exponent with
no division or logarithm, so multiplying by one is exact and a rounding-level difference in an amax between two
layouts changes a scale only where the amax crosses a power of two. The scales of a micro-batch's activations and
gradients are the micro-batch's: the same in every layout for a given micro-batch size (paratrain's loaders give
every layout the same micro-batches), not across micro-batch sizes.

`scaling="shard"` takes each amax from the slice a rank holds (no reduction): a debug switch that shows what the
reduction buys (tests/distributed/test_float8.py). A `ScaleLog` records each scale's exponent range, reduced over
the groups that split the tensor, for comparing layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from paratrain.comm import all_reduce
from paratrain.comm.regions import all_gather_along, reduce_scatter_along
from paratrain.eager import eager
from paratrain.nn.kernels import LinearSplit, check_float8_tokens, compute_dtype, power_of_two_scale, scaled_matmul
from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class Float8Recipe:
    name: str
    forward: torch.dtype
    """x and W."""
    gradient: torch.dtype
    """The output's gradient g."""
    rowwise: bool
    """One scale per row along each matmul's reduced dimension; False: one per tensor."""


FLOAT8_RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe("tensorwise", torch.float8_e4m3fn, torch.float8_e5m2, rowwise=False),
    "rowwise": Float8Recipe("rowwise", torch.float8_e4m3fn, torch.float8_e4m3fn, rowwise=True),
}
SCALINGS = ("logical", "shard")


@dataclass
class ScaleLog:
    """Every scale a float8 linear took, as (layer, operand, lowest exponent, highest exponent): the range over the
    whole logical tensor (reduced over the groups that split it), so layouts can be compared entry by entry.
    Operands: 'x', 'w' (forward), 'g', 'w_t' (input gradient), 'g_t', 'x_t' (weight gradient; tensorwise reuses
    the forward's x and g scales and records nothing more)."""

    entries: list[tuple[str, str, int, int]] = field(default_factory=list)

    def take(self) -> list[tuple[str, str, int, int]]:
        """The entries since the last take."""
        out, self.entries = self.entries, []
        return out


def _groups(*groups: AxisGroup | None) -> tuple[AxisGroup, ...]:
    seen: list[AxisGroup] = []
    for group in groups:
        if group is not None and group.size > 1 and all(group is not g for g in seen):
            seen.append(group)
    return tuple(seen)


@dataclass(frozen=True)
class Float8Linear:
    """The float8 kernel of one linear layer (a paratrain.nn.kernels.LinearKernel)."""

    recipe: Float8Recipe
    name: str
    """The layer's name in the whole model (the ScaleLog's entries)."""
    tokens: tuple[AxisGroup, ...] = ()
    """The groups that split the tokens at this layer: cp's, and under sequence parallelism tp's for a linear the
    plan leaves whole (a MoE layer's shared expert runs on the rank's chunk of the sequence); none: whole here."""
    scaling: str = "logical"
    """'logical' (amax reduced over the groups that split a tensor) or 'shard' (this rank's slice: debug only)."""
    log: ScaleLog | None = None

    @property
    def rowwise(self) -> bool:
        return self.recipe.rowwise

    @property
    def forward_dtype(self) -> torch.dtype:
        return self.recipe.forward

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.recipe.gradient

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 split: LinearSplit) -> torch.Tensor:
        y = _float8_linear(x, weight, self, split)
        return y + bias.to(y.dtype) if bias is not None else y

    def scale(self, tensor: torch.Tensor, dtype: torch.dtype, *, rows: bool, whole: Iterable[AxisGroup | None],
              split_rows: Iterable[AxisGroup | None], operand: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantised tensor, its float32 scale: [rows, 1] or a scalar) for a 2-D `tensor`.

        whole: the groups that split its columns (each row's amax runs over them); split_rows: the groups that
        split its rows (a tensorwise amax runs over them too)."""
        whole, split_rows = _groups(*whole), _groups(*split_rows)
        amax = tensor.abs().amax(dim=1, keepdim=True) if rows else tensor.abs().amax()
        amax = amax.float()
        if self.scaling == "logical":
            for group in whole + (() if rows else split_rows):
                all_reduce(amax, group, op=dist.ReduceOp.MAX)
        scale = power_of_two_scale(amax, dtype)
        if self.log is not None:
            self._record(scale, operand, _groups(*whole, *split_rows))
        return (tensor.float() * scale).to(dtype).contiguous(), scale  # (a transposed tensor's cast, laid out anew)

    def _record(self, scale: torch.Tensor, operand: str, groups: tuple[AxisGroup, ...]) -> None:
        assert self.log is not None
        exponent = torch.frexp(scale)[1].float() - 1
        span = torch.stack([-exponent.min(), exponent.max()])
        if self.scaling == "logical":
            for group in groups:
                all_reduce(span, group, op=dist.ReduceOp.MAX)
        self.log.entries.append((self.name, operand, -int(span[0]), int(span[1])))


def _gathered(flat: torch.Tensor, shape: torch.Size, split: LinearSplit) -> torch.Tensor:
    """Rows of a [tokens, n] tensor laid out as `shape`'s leading dimensions, gathered along the sequence
    (LinearSplit.sequence): the whole sequence's rows, in the same layout. Float8 travels as its bytes."""
    if split.sequence is None:
        return flat
    as_bytes = flat.view(torch.uint8) if flat.element_size() == 1 else flat
    whole = all_gather_along(as_bytes.view(*shape[:-1], flat.shape[-1]), split.sequence, split.sequence_dim)
    whole = whole.reshape(-1, flat.shape[-1])
    return whole.view(flat.dtype) if as_bytes is not flat else whole


class _Float8Matmul(torch.autograd.Function):
    """Under sequence parallelism (split.sequence) x arrives split along the sequence: it is cast first, its float8
    bytes (and rowwise scales) gathered, and only this rank's part kept for backward, which gathers it again and
    reduce-scatters the input's gradient (what _GatheredLinear does for the dense kernel, at half its bytes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, kernel: Float8Linear, split: LinearSplit,
                out_dtype: torch.dtype) -> torch.Tensor:
        recipe, rows = kernel.recipe, kernel.recipe.rowwise
        flat = x.reshape(-1, x.shape[-1])
        qx, sx = kernel.scale(flat, recipe.forward, rows=rows, whole=(split.inner,),
                              split_rows=(*kernel.tokens, split.sequence), operand="x")
        qw, sw = kernel.scale(weight, recipe.forward, rows=rows, whole=(split.inner,), split_rows=(split.out,),
                              operand="w")
        sx_all = _gathered(sx, x.shape, split) if rows else sx
        y = scaled_matmul(_gathered(qx, x.shape, split), sx_all, qw, sw, out_dtype)
        if rows:  # the weight gradient quantises x along the tokens: keep it in the compute dtype
            ctx.save_for_backward(flat.to(out_dtype), weight)
        else:  # tensorwise: the forward's float8 x and its scale serve the weight gradient as they are
            ctx.save_for_backward(qx, sx, weight, sw)
        ctx.kernel, ctx.split, ctx.x_shape, ctx.x_dtype = kernel, split, x.shape, x.dtype
        whole = list(x.shape[:-1])
        if split.sequence is not None:
            whole[split.sequence_dim] *= split.sequence.size
        return y.reshape(*whole, weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kernel, split = ctx.kernel, ctx.split
        recipe, rows = kernel.recipe, kernel.recipe.rowwise
        g = grad.reshape(-1, grad.shape[-1])
        qg, sg = kernel.scale(g, recipe.gradient, rows=rows, whole=(split.out,), split_rows=kernel.tokens,
                              operand="g")
        if rows:
            flat, weight = ctx.saved_tensors
            flat = _gathered(flat, ctx.x_shape, split)
            qwt, swt = kernel.scale(weight.t(), recipe.forward, rows=True, whole=(split.out,),
                                    split_rows=(split.inner,), operand="w_t")
            qgt, sgt = kernel.scale(g.t(), recipe.gradient, rows=True, whole=kernel.tokens,
                                    split_rows=(split.out,), operand="g_t")
            qxt, sxt = kernel.scale(flat.t(), recipe.forward, rows=True, whole=kernel.tokens,
                                    split_rows=(split.inner,), operand="x_t")
        else:
            qx, sx, weight, sw = ctx.saved_tensors
            qx = _gathered(qx, ctx.x_shape, split)
            qwt, swt = (weight.t().float() * sw).to(recipe.forward), sw  # the same values, laid out [in, out]
            qgt, sgt, qxt, sxt = qg.t(), sg, qx.t(), sx
        grad_x = scaled_matmul(qg, sg, qwt.contiguous(), swt, grad.dtype)
        # tensorwise in float32; rowwise in the compute dtype, what CUDA's row-wise _scaled_mm returns (as torchao)
        grad_w = scaled_matmul(qgt.contiguous(), sgt, qxt.contiguous(), sxt, grad.dtype if rows else torch.float32)
        if split.sequence is not None:  # the whole sequence's input gradient, summed over tp: this rank's part
            grad_x = reduce_scatter_along(grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), split.sequence,
                                          split.sequence_dim)
        return grad_x.reshape(ctx.x_shape).to(ctx.x_dtype), grad_w.to(weight.dtype), None, None, None


def _float8_linear(x: torch.Tensor, weight: torch.Tensor, kernel: Float8Linear, split: LinearSplit) -> torch.Tensor:
    """The float8 product; traced by torch.compile where no amax is reduced and nothing logged (one rank holds
    the tensors whole), run eagerly between compiled pieces otherwise (collectives, the log)."""
    out_dtype = compute_dtype(x)
    if x.device.type == "meta":  # a dry run: shapes only
        return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype, device=x.device)
    check_float8_tokens(x, kernel.name)
    local = kernel.log is None and split.sequence is None and (
        kernel.scaling == "shard" or not _groups(*kernel.tokens, split.out, split.inner))
    return (_Float8Matmul.apply if local else _eager_matmul)(x, weight, kernel, split, out_dtype)


@eager  # its amax reductions are collectives: torch.compile breaks its graph here
def _eager_matmul(x: torch.Tensor, weight: torch.Tensor, kernel: Float8Linear, split: LinearSplit,
                  out_dtype: torch.dtype) -> torch.Tensor:
    return _Float8Matmul.apply(x, weight, kernel, split, out_dtype)
