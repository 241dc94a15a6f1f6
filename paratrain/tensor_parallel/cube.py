"""The 3D tensor-parallel cube (Bian et al. 2021, arXiv 2105.14450): tp = q^3 ranks, rank (a, b, c) on three axes.

    input   "tp_input"    ranks (0, b, c) .. (q-1, b, c); index a
    weight  "tp_weight"   ranks (a, 0, c) .. (a, q-1, c); index b
    output  "tp_output"   ranks (a, b, 0) .. (a, b, q-1); index c      (tp_index = a q^2 + b q + c)

An activation [B, S, h] is cut q^2 ways along its rows and q ways along its width, in one of two layouts:

    stream   x[rows b q + a, h_c]     between the blocks: the residual stream, a norm's input, the embedding's output
    turned   x[rows b q + c, h_a]     inside a block: after a column layer (the attention heads, the MLP's width)

A linear gathers its input's rows over one axis and its weight over the weight axis, multiplies, and
reduce-scatters the partial sums over the third; a column layer (stream -> turned) gathers over input and
scatters over output, a row layer (turned -> stream) the other way round, so the two swap the input and output
axes as the paper does. With (G, R) = (input, output) for a column and (output, input) for a row:

    W[out, in] -> W[out_(g q + b), in_r]          q^2 blocks of the output dim, q of the input dim
    forward    X_g = all-gather_G(x)                  [rows b (of q), in_r]              T in / q^2
               W_b = all-gather_weight(W)             [out_g, in_r]                      |W| / q^2
               y   = reduce-scatter_R(X_g W_b^T)      [rows b q + r, out_g]              T out / q^2 (input)
    backward   dP  = all-gather_R(dy); X_g and W_b gathered again (only this rank's blocks are saved)
               dx  = reduce-scatter_G(dP W_b)                                           T in / q^2
               dW  = reduce-scatter_weight(dP^T X_g)                                    |W| / q^2

so per linear, forward and backward, each rank moves 3 T in / q^2 + 2 T out / q^2 + 3 |W| / q^2 elements (an
all-gather counted by its output, a reduce-scatter by its input: paratrain.comm.volume). Activations per rank are
T h / q^3 = T h / tp, and so are the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.comm.regions import all_gather_along, reduce_scatter_along
from paratrain.eager import eager
from paratrain.nn.kernels import compute_dtype
from paratrain.tensor_parallel.grid import Activations
from paratrain.topology.mesh import AxisGroup, Mesh


@dataclass(frozen=True)
class Cube:
    input: AxisGroup
    weight: AxisGroup
    output: AxisGroup
    tp: AxisGroup

    @classmethod
    def of(cls, mesh: Mesh) -> Cube:
        missing = [axis for axis in ("tp", "tp_input", "tp_weight", "tp_output") if axis not in mesh.groups]
        if missing:
            raise ValueError(f"the mesh has no {', '.join(missing)} group: a cube needs dims with tp_mode '3d' and "
                             f"tp = q^3, q >= 2 (tp is {mesh.dims.tp}, tp_mode {mesh.dims.tp_mode!r})")
        return cls(mesh.groups["tp_input"], mesh.groups["tp_weight"], mesh.groups["tp_output"], mesh.groups["tp"])

    @property
    def q(self) -> int:
        return self.input.size

    @property
    def stream(self) -> Activations:
        """x[rows b q + a, h_c]: between the blocks."""
        return Activations(self.output, (self.input, self.weight))

    @property
    def turned(self) -> Activations:
        """x[rows b q + c, h_a]: after a column layer."""
        return Activations(self.input, (self.output, self.weight))

    def axes(self, style: str) -> tuple[AxisGroup, AxisGroup]:
        """(G, R) of a 'column' or 'row' linear: the axis its input's rows are gathered over, and the one its
        partial sums are reduce-scattered over."""
        return (self.input, self.output) if style == "column" else (self.output, self.input)


class _CubeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, gather: AxisGroup, across: AxisGroup,
                scatter: AxisGroup) -> torch.Tensor:
        dtype = compute_dtype(x)
        x, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, w)
        ctx.groups, ctx.weight_dtype = (gather, across, scatter), weight.dtype
        partial = torch.nn.functional.linear(all_gather_along(x, gather, 0), all_gather_along(w, across, 0))
        return reduce_scatter_along(partial, scatter, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gather, across, scatter = ctx.groups
        g = all_gather_along(grad.to(w.dtype).contiguous(), scatter, 0)  # [rows of the G-gathered block, out_g]
        xg, wg = all_gather_along(x, gather, 0), all_gather_along(w, across, 0)
        grad_x = reduce_scatter_along(g @ wg, gather, 0)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ xg.reshape(-1, xg.shape[-1])  # [out_g, in_r], rows b's share
        # summed in the weight's dtype (float32 under autocast)
        return grad_x, reduce_scatter_along(grad_w.to(ctx.weight_dtype), across, 0), None, None, None


@eager  # collectives run eagerly: torch.compile breaks its graph here
def cube_linear(x: torch.Tensor, weight: torch.Tensor, cube: Cube, style: str) -> torch.Tensor:
    """x (rows and width cut as the style's input layout) @ weight^T -> the output layout's block."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"a 3d cube {style} linear takes its input's width block of {weight.shape[1]} (in / q, q = "
                         f"{cube.q}), got {x.shape[-1]}: its input must come from a cube layer (the plan must cover "
                         "every module between the embedding and the loss)")
    gather, scatter = cube.axes(style)
    return _CubeLinear.apply(x, weight, gather, cube.weight, scatter)
