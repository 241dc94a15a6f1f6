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
from paratrain.tensor_parallel.grid import Grid
from paratrain.tensor_parallel.layers import compute_dtype


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
def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid) -> torch.Tensor:
    """x[..., in/q] (rows B_i, input block j) @ weight[out/q, in/q]^T over the grid -> [..., out/q] (rows B_i,
    output block j)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"a 2d grid linear takes its input's width block of {weight.shape[1]} (in / q, q = {grid.q}), "
                         f"got {x.shape[-1]}: its input must come from a grid layer (the plan must cover every "
                         "module between the embedding and the loss)")
    return _SummaLinear.apply(x, weight, grid)
