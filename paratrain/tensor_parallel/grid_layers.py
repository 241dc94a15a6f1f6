"""The layers of a model on the 2D grid (paratrain.tensor_parallel.grid), each built from the whole layer by
slicing it, so tp 1, 1d and 2d start from the same numbers. Rank (i, j) of a q x q grid:

    GridLinear       W[out, in] -> W[out_i, in_j], b[out] -> b[out_j]
                     x[B_i, S, in_j] -> y[B_i, S, out_j] by SUMMA (paratrain.tensor_parallel.summa); the bias
                     is added on every row, its gradient summed down the column
    GridEmbedding    E[V, h] -> E[V_i, h_j]
                     ids[B, S] (whole, as every tp rank reads them) -> x[B_i, S, h_j]: each rank looks up
                     every row in its vocabulary block (zeros elsewhere), and a reduce-scatter down the column
                     sums the blocks and leaves rank (i, j) its rows B_i: this is where the batch is split
    SplitNorm        RMSNorm / LayerNorm over h: statistics of x[B_i, S, h_j] summed along the row; g[h] -> g[h_j];
                     an RMSNorm keeps only x and 1 / rms, as paratrain's own (paratrain.nn.norms)
    SplitOutput      the loss on logits[B_i, S, V_j]: the vocab-parallel cross-entropy along the row on the
                     targets' rows B_i, then the loss summed down the column (every tp rank holds the whole sum)

SplitNorm and SplitOutput take the layout of their activation (paratrain.tensor_parallel.grid.Activations), so the
3D cube (paratrain.tensor_parallel.cube_layers) uses them too.

2.5d (tp_depth d > 1): every grid runs the above on its own share of the rows (GridEmbedding takes grid k's
share of the ids first, SplitOutput sums the loss over depth too), and every parameter's gradient is summed over
depth in the layer's backward (a vector's with its column's).

Backward of each (collectives on gradients of the same shapes):
    GridEmbedding    all-gather of dx[B_i, S, h_j] down the column, then the lookup's backward
    SplitNorm        the statistics' gradient summed along the row; dg[h_j] summed down the column
    SplitOutput      none beyond the cross-entropy's (the column's sum passes the gradient through)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm.collectives import all_reduce
from paratrain.comm.regions import (copy_to_tp_region, gather_along_region, gather_from_sequence_region,
                                    gather_from_tp_region, reduce_from_tp_region, reduce_scatter_to_sequence_region,
                                    sum_in_region)
from paratrain.nn.kernels import kernel_of
from paratrain.nn.norms import upcast
from paratrain.tensor_parallel.grid import Activations, Block, Grid
from paratrain.tensor_parallel.loss import vocab_parallel_cross_entropy
from paratrain.tensor_parallel.summa import summa_linear
from paratrain.topology.mesh import AxisGroup


GRID_DOCUMENTS = ("packed documents (positions) under tp_mode 2d, 2.5d or 3d: the grid cuts each micro-batch's rows "
                  "into blocks, and the documents' attention masks are not cut with them yet; train without "
                  "--documents, or with tp_mode 1d")


def cut(tensor: torch.Tensor, what: str, cuts: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
    """This rank's block of a whole tensor: block `index` of `parts` along `dim` for each (dim, index, parts)."""
    part = tensor.detach()
    for dim, index, parts in cuts:
        size = part.shape[dim]
        if size % parts:
            raise ValueError(f"{what}: dim {dim} of size {size} must be divisible by {parts} (the grid's blocks "
                             "along it)")
        part = part.narrow(dim, index * (size // parts), size // parts)
    return part.clone()


def parameter(full: torch.Tensor, block: Block, what: str) -> nn.Parameter:
    """The block of `full` a Block describes, as a parameter that trains, or stays frozen, as `full` does."""
    return nn.Parameter(cut(full, what, block.cuts), requires_grad=full.requires_grad)


def check_rows(x: torch.Tensor, parts: int, what: str) -> None:
    if x.shape[0] % parts:
        raise ValueError(f"{what}: the grid splits the micro-batch's {x.shape[0]} rows into {parts} blocks: make the "
                         f"micro-batch a multiple of {parts}")


def copied(param: torch.Tensor, groups: tuple[AxisGroup, ...]) -> torch.Tensor:
    """A block the ranks of `groups` each apply to their own rows: its gradient summed over them."""
    for group in groups:
        param = copy_to_tp_region(param, group)
    return param


def vector_block(acts: Activations) -> Block:
    """v[h]: cut as the activation's width, copied over its rows' groups."""
    return Block(((0, acts.width.index, acts.width.size),), ((acts.width, 0),), acts.width, acts.rows)


def matrix_block(grid: Grid) -> Block:
    """W[out_i, in_j] (or E[V_i, h_j]): one rank per block of each grid, counted and saved on grid 0."""
    depth = (grid.depth,) if grid.depth is not None else ()
    return Block(((0, grid.i, grid.q), (1, grid.j, grid.q)), ((grid.row, 1), (grid.col, 0)), grid.tp, depth,
                 counted=grid.k == 0)


class GridLinear(nn.Module):
    def __init__(self, full: nn.Linear, grid: Grid, *, gather: bool = False) -> None:
        """gather: the output gathered whole on every rank (the column_gather style)."""
        super().__init__()
        self.grid, self.gather = grid, gather
        self.weight = parameter(full.weight, matrix_block(grid), "2d linear weight")
        self.bias = parameter(full.bias, vector_block(grid.stream), "2d linear bias") if full.bias is not None else None
        self.kernel = kernel_of(full)  # how the layer it slices multiplied (paratrain.nn.kernels)

    def blocks(self) -> dict[str, Block]:
        return {"weight": matrix_block(self.grid), "bias": vector_block(self.grid.stream)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_linear(x, self.weight, self.grid, self.kernel)
        if self.bias is not None:
            y = y + copied(self.bias, self.grid.stream.rows).to(y.dtype)  # every row adds it: summed down
        return gathered(y, self.grid.stream) if self.gather else y


class GridEmbedding(nn.Module):
    refuses_positions = GRID_DOCUMENTS
    """paratrain.nn.documents.refuse_documents reads it: the rows' blocks do not cut the documents' masks yet."""

    def __init__(self, full: nn.Embedding, grid: Grid) -> None:
        super().__init__()
        self.grid = grid
        self.weight = parameter(full.weight, matrix_block(grid), "2d embedding")
        self.vocab_start = grid.i * self.weight.shape[0]
        self.padding_idx = local_padding(full, self.vocab_start, self.weight.shape[0])
        scale = getattr(full, "embed_scale", None)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)

    def blocks(self) -> dict[str, Block]:
        return {"weight": matrix_block(self.grid)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        grid = self.grid
        check_rows(ids, grid.stream.row_parts, "2d embedding")
        if grid.depth is not None:  # 2.5d: grid k's share of the rows, the gradient summed over the stack
            ids = ids.narrow(0, grid.k * (ids.shape[0] // grid.d), ids.shape[0] // grid.d)
        weight = self.weight if grid.depth is None else copy_to_tp_region(self.weight, grid.depth)
        rows = lookup(ids, weight, self.vocab_start, self.padding_idx, getattr(self, "embed_scale", None))
        return reduce_scatter_to_sequence_region(rows, grid.col, 0)  # [B_i, S, h_j], the column's sum


def local_padding(full: nn.Embedding, start: int, rows: int) -> int | None:
    """The padding row in a block of the vocabulary starting at `start` (its gradient stays zero), if it holds it."""
    pad = full.padding_idx
    return pad - start if pad is not None and start <= pad < start + rows else None


def lookup(ids: torch.Tensor, weight: torch.Tensor, start: int, padding_idx: int | None,
           scale: torch.Tensor | None) -> torch.Tensor:
    """Rows of every id in the vocabulary block [start, start + rows) of `weight`, zeros for the others."""
    outside = (ids < start) | (ids >= start + weight.shape[0])
    local = (ids - start).masked_fill(outside, 0)
    rows = F.embedding(local, weight, padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
    return rows * scale.to(weight.dtype) if scale is not None else rows


class SplitNorm(nn.Module):
    """RMSNorm (paratrain's, torch's, Hugging Face's: x / rms(x) in float32, back to x's dtype, times the weight) or
    LayerNorm over a width cut along `acts.width`."""

    def __init__(self, full: nn.Module, acts: Activations) -> None:
        super().__init__()
        self.acts = acts
        self.rms = not isinstance(full, nn.LayerNorm)  # paratrain's, torch's or Hugging Face's (variance_epsilon)
        self.float32 = hasattr(full, "variance_epsilon")  # Hugging Face's computes in float32 whatever x's dtype
        weight = full.weight
        self.width = weight.numel()
        eps = getattr(full, "eps", None) if hasattr(full, "eps") else getattr(full, "variance_epsilon", None)
        self.eps = float(eps) if eps is not None else None
        """None: torch's nn.RMSNorm default, the input's dtype's machine epsilon."""
        self.weight = parameter(weight, vector_block(acts), "split norm weight")
        bias = getattr(full, "bias", None)
        self.bias = parameter(bias, vector_block(acts), "split norm bias") if bias is not None else None

    def blocks(self) -> dict[str, Block]:
        return {"weight": vector_block(self.acts), "bias": vector_block(self.acts)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if self.rms and self.bias is None:
            weight = copied(self.weight, self.acts.rows)
            return _SplitRMSNorm.apply(x, weight, eps, self.width, self.acts.width, self.float32)
        wide, group = (x.to(torch.float32) if self.float32 else upcast(x)), self.acts.width
        if not self.rms:  # LayerNorm: centred first, by the mean over the whole width
            wide = wide - sum_in_region(wide.sum(-1, keepdim=True), group) / self.width
        squares = sum_in_region(wide.pow(2).sum(-1, keepdim=True), group)
        y = (wide * torch.rsqrt(squares / self.width + eps)).type_as(x)
        y = y * copied(self.weight, self.acts.rows)
        return y + copied(self.bias, self.acts.rows) if self.bias is not None else y


class _SplitRMSNorm(torch.autograd.Function):
    """x / rms(x) * weight over a width cut along `group` (paratrain.nn.norms._RMSNorm's arithmetic, the sums over
    the width all-reduced): keeps x in its own dtype and 1 / rms (one per row), recomputing the rest in backward, so a
    norm on the grid keeps what the 1d one keeps for its rows and width."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, width: int,  # type: ignore[override]
                group: AxisGroup, float32: bool) -> torch.Tensor:
        wide = x.to(torch.float32) if float32 else upcast(x)
        squares = wide.pow(2).sum(-1, keepdim=True)
        all_reduce(squares, group)
        rstd = torch.rsqrt(squares / width + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.group, ctx.float32 = width, group, float32
        return (wide * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        wide = x.to(torch.float32) if ctx.float32 else upcast(x)
        normed = (wide * rstd).type_as(x)
        grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)  # this rank's rows
        grad_normed = (grad * weight).to(wide.dtype)
        grad_rstd = (grad_normed * wide).sum(-1, keepdim=True)
        all_reduce(grad_rstd, ctx.group)  # over the whole width
        grad_mean = grad_rstd * -0.5 * rstd.pow(3)
        grad_wide = grad_normed * rstd + grad_mean * (2.0 / ctx.width) * wide
        return grad_wide.to(x.dtype), grad_weight, None, None, None, None


def gathered(y: torch.Tensor, acts: Activations) -> torch.Tensor:
    """A block gathered whole on every rank ([B, S, out]: HF's lm_head before its loss), as 1d's column_gather:
    every rank then computes the same thing, so backward keeps this rank's block of the gradient."""
    y = gather_along_region(y, acts.width, -1)
    for group in acts.rows:
        y = gather_along_region(y, group, 0)
    return y


class SplitOutput(nn.Module):
    """paratrain.nn.loss.VocabOutput for logits whose vocabulary is cut along `acts.width` and rows in blocks."""

    def __init__(self, vocab_size: int, acts: Activations, *, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size, self.acts, self.ignore_index = vocab_size, acts, ignore_index

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token cross-entropies, number of tokens) over the whole micro-batch, the same on every tp
        rank; targets[B, S] whole, as every tp rank reads them."""
        check_rows(targets, self.acts.row_parts, "grid loss")
        part = targets.shape[0] // self.acts.row_parts
        mine = targets.narrow(0, self.acts.row_block * part, part)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1),
                                              self.acts.width, ignore_index=self.ignore_index,
                                              vocab_size=self.vocab_size)
        total = losses.sum()
        for group in self.acts.rows:  # every row block's
            total = reduce_from_tp_region(total, group)
        return total, (targets != self.ignore_index).sum()

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """logits[B, S, vocab_size]: every rank's block gathered (for sampling), padding dropped."""
        whole = gather_from_tp_region(logits, self.acts.width)
        for group in self.acts.rows:
            whole = gather_from_sequence_region(whole, group, 0)
        return whole[..., : self.vocab_size]
