"""The layers of a model on the 2D grid (paratrain.tensor_parallel.grid), each built from the whole layer by
slicing it, so tp 1, 1d and 2d start from the same numbers. Rank (i, j) of a q x q grid:

    GridLinear       W[out, in] -> W[out_i, in_j], b[out] -> b[out_j]
                     x[B_i, S, in_j] -> y[B_i, S, out_j] by SUMMA (paratrain.tensor_parallel.summa); the bias
                     is added on every row, its gradient summed down the column
    GridEmbedding    E[V, h] -> E[V_i, h_j]
                     ids[B, S] (whole, as every tp rank reads them) -> x[B_i, S, h_j]: each rank looks up
                     every row in its vocabulary block (zeros elsewhere), and a reduce-scatter down the column
                     sums the blocks and leaves rank (i, j) its rows B_i: this is where the batch is split
    GridNorm         RMSNorm / LayerNorm over h: statistics of x[B_i, S, h_j] summed along the row; g[h] -> g[h_j]
    GridOutput       the loss on logits[B_i, S, V_j]: the vocab-parallel cross-entropy along the row on the
                     targets' rows B_i, then the loss summed down the column (every tp rank holds the whole sum)

2.5d (tp_depth d > 1): every grid runs the above on its own share of the rows (GridEmbedding takes grid k's
share of the ids first, GridOutput sums the loss over depth too), and every parameter's gradient is summed over
depth in the layer's backward (a vector's with its column's).

Backward of each (collectives on gradients of the same shapes):
    GridEmbedding    all-gather of dx[B_i, S, h_j] down the column, then the lookup's backward
    GridNorm         the statistics' gradient summed along the row; dg[h_j] summed down the column
    GridOutput       none beyond the cross-entropy's (the column's sum passes the gradient through)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm.regions import (copy_to_tp_region, gather_from_sequence_region, gather_from_tp_region,
                                    reduce_from_tp_region, reduce_scatter_to_sequence_region, sum_in_region)
from paratrain.models.norms import RMSNorm, upcast
from paratrain.tensor_parallel.grid import Grid
from paratrain.tensor_parallel.loss import vocab_parallel_cross_entropy
from paratrain.tensor_parallel.summa import summa_linear


def block(tensor: torch.Tensor, grid: Grid, what: str, dims: tuple[int, ...]) -> torch.Tensor:
    """This rank's block of a whole tensor: dims[0] cut by the grid row i, dims[1] (if given) by the column j."""
    part = tensor.detach()
    for dim, index in zip(dims, (grid.i, grid.j) if len(dims) == 2 else (grid.j,)):
        size = part.shape[dim]
        if size % grid.q:
            raise ValueError(f"{what}: dim {dim} of size {size} must be divisible by the grid side q = {grid.q} "
                             f"(tp {grid.q * grid.q} in 2d)")
        part = part.narrow(dim, index * (size // grid.q), size // grid.q)
    return part.clone()


def _parameter(full: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=full.requires_grad)


def _rows(x: torch.Tensor, grid: Grid, what: str) -> None:
    if x.shape[0] % grid.row_parts:
        raise ValueError(f"{what}: the grid splits the micro-batch's {x.shape[0]} rows into {grid.row_parts} blocks "
                         f"(q = {grid.q} grid rows x depth {grid.d}): make the micro-batch a multiple of {grid.row_parts}")


def _copied(param: torch.Tensor, grid: Grid) -> torch.Tensor:
    """A vector block every rank of its column (and depth) adds to its own rows: its gradient summed over them."""
    for group in grid.copies:
        param = copy_to_tp_region(param, group)
    return param


def _share(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """2.5d: grid k's share of the micro-batch's rows (the rows of every grid, whole, under 2d)."""
    if grid.d == 1:
        return x
    part = x.shape[0] // grid.d
    return x.narrow(0, grid.k * part, part)


class GridLinear(nn.Module):
    def __init__(self, full: nn.Linear, grid: Grid) -> None:
        super().__init__()
        self.grid = grid
        self.weight = _parameter(full.weight, block(full.weight, grid, "2d linear weight", (0, 1)))
        self.bias = (_parameter(full.bias, block(full.bias, grid, "2d linear bias", (0,)))
                     if full.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_linear(x, self.weight, self.grid)
        if self.bias is None:
            return y
        return y + _copied(self.bias, self.grid).to(y.dtype)  # every row adds it: summed down


class GridEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, grid: Grid) -> None:
        super().__init__()
        self.grid = grid
        self.weight = _parameter(full.weight, block(full.weight, grid, "2d embedding", (0, 1)))
        self.vocab_start = grid.i * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]
        pad = full.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        scale = getattr(full, "embed_scale", None)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _rows(ids, self.grid, "2d embedding")
        ids = _share(ids, self.grid)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        weight = self.weight if self.grid.depth is None else copy_to_tp_region(self.weight, self.grid.depth)
        rows = F.embedding(local, weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if hasattr(self, "embed_scale"):
            rows = rows * self.embed_scale.to(self.weight.dtype)
        return reduce_scatter_to_sequence_region(rows, self.grid.col, 0)  # [B_i, S, h_j], the column's sum


class GridNorm(nn.Module):
    """RMSNorm (paratrain's, torch's) or LayerNorm over a width split along the row."""

    def __init__(self, full: nn.Module, grid: Grid) -> None:
        super().__init__()
        self.grid = grid
        self.rms = isinstance(full, (RMSNorm, nn.RMSNorm))
        weight = full.weight
        self.width = weight.numel()
        eps = full.eps if isinstance(full, RMSNorm) else (full.eps if full.eps is not None else torch.finfo(weight.dtype).eps)
        self.eps = float(eps)
        self.weight = _parameter(weight, block(weight, grid, "2d norm weight", (0,)))
        bias = getattr(full, "bias", None)
        self.bias = _parameter(bias, block(bias, grid, "2d norm bias", (0,))) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = upcast(x)
        if not self.rms:  # LayerNorm: centred first, by the mean over the whole width
            wide = wide - sum_in_region(wide.sum(-1, keepdim=True), self.grid.row) / self.width
        squares = sum_in_region(wide.pow(2).sum(-1, keepdim=True), self.grid.row)
        y = (wide * torch.rsqrt(squares / self.width + self.eps)).type_as(x)
        y = y * _copied(self.weight, self.grid)
        return y + _copied(self.bias, self.grid) if self.bias is not None else y


class GridOutput(nn.Module):
    """paratrain.nn.loss.VocabOutput for logits[B_i, S, V_j] on the grid."""

    def __init__(self, vocab_size: int, grid: Grid, *, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.grid, self.ignore_index = vocab_size, grid, ignore_index

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token cross-entropies, number of tokens) over the whole micro-batch, the same on every tp
        rank; targets[B, S] whole, as every tp rank reads them."""
        _rows(targets, self.grid, "2d loss")
        part = targets.shape[0] // self.grid.row_parts
        mine = targets.narrow(0, self.grid.row_block * part, part)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1), self.grid.row,
                                              ignore_index=self.ignore_index, vocab_size=self.vocab_size)
        total = losses.sum()
        for group in self.grid.copies:  # every row block's: down the column, and over depth
            total = reduce_from_tp_region(total, group)
        return total, (targets != self.ignore_index).sum()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[B, S, vocab_size]: every rank's block gathered (for sampling), padding dropped."""
        whole = gather_from_sequence_region(gather_from_tp_region(logits, self.grid.row), self.grid.col, 0)
        if self.grid.depth is not None:
            whole = gather_from_sequence_region(whole, self.grid.depth, 0)
        return whole[..., : self.vocab_size]
