"""SUMMA on the 2D grid: Y = X W^T with X, W and Y each in q x q blocks, by broadcasts and reduces.

Rank (i, j) holds X_ij = X[B_i, in_j], W_ij = W[out_i, in_j] (torch's [out, in]) and produces Y_ij = Y[B_i, out_j].
Y[B_i, out_s] = sum_j X_ij W_sj^T, so in step s = 0 .. q-1 (van de Geijn and Watts 1997; Optimus, Xu et al. 2021):

    forward    W_sj   broadcast down column j from (s, j)         [out/q, in/q]
               X_ij W_sj^T, reduced along row i to (i, s)        [T/q, out/q]   -> Y_is on rank (i, s)
    backward   dY_is  broadcast along row i from (i, s)           [T/q, out/q]
               W_sj   broadcast down column j from (s, j)         [out/q, in/q]
               dX_ij += dY_is W_sj                                 (local)
               dY_is^T X_ij, reduced down column j to (s, j)      [out/q, in/q]  -> dW_sj on rank (s, j)

(T: the tokens of the micro-batch, B S.) Per rank and linear, forward and backward move, counting a broadcast or
reduce of n elements as n (paratrain.comm.volume):

    forward  T out / q + |W| / q        backward  T out / q + 2 |W| / q        |W| = out in

Only this rank's blocks are saved for backward (X_ij and W_ij); the broadcast blocks are received again. A weight
block's gradient is whole over the grid's rows when it arrives (the reduce sums every row's tokens); under 2.5D an
all-reduce over depth (2 |W| / q^2) adds the other grids' rows. The gradient strategies then see it as they see any
parameter's.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm.collectives import all_reduce, broadcast, reduce
from paratrain.eager import eager
from paratrain.nn.kernels import (LinearKernel, QuantisingKernel, check_float8_tokens, compute_dtype, dense_linear,
                                  scaled_matmul)
from paratrain.tensor_parallel.grid import Grid
from paratrain.topology.mesh import AxisGroup


def _received(own: torch.Tensor, buffer: torch.Tensor, mine: bool) -> torch.Tensor:
    """The tensor a broadcast step sends from here (`own`) or receives into (`buffer`)."""
    return own if mine else buffer


class _SummaLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
        dtype = compute_dtype(x)
        x, w = x.to(dtype), weight.to(dtype).contiguous()  # blocks travel in the compute dtype
        ctx.save_for_backward(x, w)
        ctx.grid, ctx.weight_dtype = grid, weight.dtype
        rows = x.reshape(-1, x.shape[-1])
        received = torch.empty_like(w)
        out = None
        for s in range(grid.q):
            w_s = _received(w, received, grid.i == s)
            broadcast(w_s, grid.col, src_index=s)  # W[out_s, in_j]
            partial = rows @ w_s.t()  # [T/q, out/q]: this column's share of Y[B_i, out_s]
            reduce(partial, grid.row, dst_index=s)
            if grid.j == s:
                out = partial
        assert out is not None
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        grid: Grid = ctx.grid
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype).contiguous()  # dY[B_i, out_j]
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = torch.zeros_like(rows)
        g_received, w_received = torch.empty_like(g), torch.empty_like(w)
        grad_weight = None
        for s in range(grid.q):
            g_s = _received(g, g_received, grid.j == s)
            broadcast(g_s, grid.row, src_index=s)  # dY[B_i, out_s]
            w_s = _received(w, w_received, grid.i == s)
            broadcast(w_s, grid.col, src_index=s)  # W[out_s, in_j]
            grad_rows += g_s @ w_s
            # [out/q, in/q]: row i's share of dW[out_s, in_j], summed in the weight's dtype (float32 under autocast)
            partial = (g_s.t() @ rows).to(ctx.weight_dtype)
            reduce(partial, grid.col, dst_index=s)
            if grid.i == s:
                grad_weight = partial
        assert grad_weight is not None
        if grid.depth is not None:  # 2.5d: every stacked grid's rows
            all_reduce(grad_weight, grid.depth)
        return grad_rows.view_as(x), grad_weight, None


@eager  # collectives run eagerly: torch.compile breaks its graph here
def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid,
                 kernel: LinearKernel = dense_linear) -> torch.Tensor:
    """x[..., in/q] (rows B_i, input block j) @ weight[out/q, in/q]^T over the grid -> [..., out/q] (rows B_i,
    output block j). kernel: the linear's (paratrain.nn.kernels): dense, or one that casts (float8)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"a 2d grid linear takes its input's width block of {weight.shape[1]} (in / q, q = {grid.q}), "
                         f"got {x.shape[-1]}: its input must come from a grid layer (the plan must cover every "
                         "module between the embedding and the loss)")
    if kernel is dense_linear:
        return _SummaLinear.apply(x, weight, grid)
    if not isinstance(kernel, QuantisingKernel):
        raise ValueError(f"a 2d grid linear multiplies densely or with a casting kernel, got {kernel!r}")
    if x.device.type == "meta":  # a dry run: shapes only
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=compute_dtype(x))
    check_float8_tokens(x, "a 2d grid linear")
    return _Float8Summa.apply(x, weight, grid, kernel, compute_dtype(x))


def _broadcast_cast(tensor: torch.Tensor, scale: torch.Tensor, group: AxisGroup, *, src: int,
                    mine: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 block and its scale from `src` of `group` (float8 travels as its bytes)."""
    block = tensor if mine else torch.empty_like(tensor)
    scales = scale if mine else torch.empty_like(scale)
    broadcast(block.view(torch.uint8), group, src_index=src)
    broadcast(scales, group, src_index=src)
    return block, scales


class _Float8Summa(torch.autograd.Function):
    """SUMMA with float8 blocks: each block cast once, by its owner, with the scale of the logical tensor (the amax
    reduced over the grid's groups that split it: paratrain.memory.float8), then broadcast as float8 with its scale.

        x[B_i, in_j]     its rows' amax along in: the grid row; its tensor's also over the column, depth and cp
        W[out_i, in_j]   along in (forward's rows): the row; along out (backward's columns): the column
        dY[B_i, out_j]   along out: the row; dY^T and x^T along the tokens: the column, depth and cp"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grid: Grid, kernel: QuantisingKernel,
                out_dtype: torch.dtype) -> torch.Tensor:
        rows, rowwise, fwd = x.reshape(-1, x.shape[-1]), kernel.rowwise, kernel.forward_dtype
        tokens = (grid.col, grid.depth, *kernel.tokens)
        qx, sx = kernel.scale(rows, fwd, rows=rowwise, whole=(grid.row,), split_rows=tokens, operand="x")
        qw, sw = kernel.scale(weight, fwd, rows=rowwise, whole=(grid.row,), split_rows=(grid.col,), operand="w")
        out = None
        for s in range(grid.q):
            w_s, sw_s = _broadcast_cast(qw, sw, grid.col, src=s, mine=grid.i == s)  # W[out_s, in_j]
            partial = scaled_matmul(qx, sx, w_s, sw_s, out_dtype)  # this column's share of Y[B_i, out_s]
            reduce(partial, grid.row, dst_index=s)
            if grid.j == s:
                out = partial
        assert out is not None
        ctx.save_for_backward(rows.to(out_dtype) if rowwise else qx, sx, qw, sw, weight)
        ctx.grid, ctx.kernel, ctx.x_shape, ctx.x_dtype = grid, kernel, x.shape, x.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved, sx, qw, sw, weight = ctx.saved_tensors
        grid, kernel = ctx.grid, ctx.kernel
        rowwise, fwd, bwd = kernel.rowwise, kernel.forward_dtype, kernel.gradient_dtype
        tokens = (grid.col, grid.depth, *kernel.tokens)
        g = grad.reshape(-1, grad.shape[-1])  # dY[B_i, out_j]
        qg, sg = kernel.scale(g, bwd, rows=rowwise, whole=(grid.row,), split_rows=tokens, operand="g")
        if rowwise:  # W^T's rows (in) along out, dY^T's (out) and x^T's (in) along the tokens
            qwt, swt = kernel.scale(weight.t(), fwd, rows=True, whole=(grid.col,), split_rows=(grid.row,),
                                    operand="w_t")
            qgt, sgt = kernel.scale(g.t(), bwd, rows=True, whole=tokens, split_rows=(grid.row,), operand="g_t")
            qxt, sxt = kernel.scale(saved.t(), fwd, rows=True, whole=tokens, split_rows=(grid.row,), operand="x_t")
        else:  # one scale a tensor: the forward's casts, transposed (dY^T from the broadcast dY itself)
            qwt, swt, qgt, sgt, qxt, sxt = qw.t().contiguous(), sw, None, sg, saved.t().contiguous(), sx
        grad_rows = torch.zeros(g.shape[0], qxt.shape[0], dtype=grad.dtype, device=grad.device)
        grad_weight = None
        # tensorwise dW in float32; rowwise in the compute dtype, what CUDA's row-wise _scaled_mm returns
        dw_dtype = grad.dtype if rowwise else torch.float32
        for s in range(grid.q):
            g_s, sg_s = _broadcast_cast(qg, sg, grid.row, src=s, mine=grid.j == s)  # dY[B_i, out_s]
            if rowwise:  # dY[B_i, out_s]^T, cast along the tokens
                gt_s, sgt_s = _broadcast_cast(qgt, sgt, grid.row, src=s, mine=grid.j == s)
            else:
                gt_s, sgt_s = g_s.t(), sg_s
            wt_s, swt_s = _broadcast_cast(qwt, swt, grid.col, src=s, mine=grid.i == s)  # W[out_s, in_j]^T
            grad_rows += scaled_matmul(g_s, sg_s, wt_s, swt_s, grad.dtype)
            partial = scaled_matmul(gt_s.contiguous(), sgt_s, qxt, sxt, dw_dtype).to(weight.dtype)
            reduce(partial, grid.col, dst_index=s)  # row i's share of dW[out_s, in_j]
            if grid.i == s:
                grad_weight = partial
        assert grad_weight is not None
        if grid.depth is not None:  # 2.5d: every stacked grid's rows
            all_reduce(grad_weight, grid.depth)
        return grad_rows.view(ctx.x_shape).to(ctx.x_dtype), grad_weight, None, None, None
