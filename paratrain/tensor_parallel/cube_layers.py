"""The layers of a model on the 3D cube (paratrain.tensor_parallel.cube), built from the whole layer by slicing it.
Rank (a, b, c); a column layer takes the stream layout to the turned one, a row layer back:

    CubeLinear      W[out, in] -> W[out_(g q + b), in_r]   ((g, r) = (a, c) for a column, (c, a) for a row)
                    b[out] -> b[out_g]: cut as the output's width, copied over its rows' axes
    CubeEmbedding   E[V, h] -> E[V_(a q + b), h_c] (a column layer's cut: a head tied to it stays one parameter)
                    ids[B, S] (whole) -> x[rows b q + a, h_c]: each rank looks up every row in its vocabulary block,
                    a reduce-scatter over the weight axis sums and leaves rows block b, one over the input axis
                    rows block b q + a (backward: the two all-gathers)

Norms and the loss are paratrain.tensor_parallel.grid_layers' SplitNorm (stream: statistics over the output axis)
and SplitOutput (the turned logits of a column head: the vocabulary along the input axis).
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.comm.regions import reduce_scatter_to_sequence_region
from paratrain.nn.kernels import dense_linear, kernel_of
from paratrain.tensor_parallel.cube import Cube, cube_linear
from paratrain.tensor_parallel.grid import Block
from paratrain.tensor_parallel.grid_layers import (GRID_DOCUMENTS, check_rows, copied, gathered, local_padding, lookup, parameter,
                                                  vector_block)


def cube_matrix(cube: Cube, style: str) -> Block:
    """W[out_(g q + b), in_r] of a column or row layer (an embedding: a column's)."""
    g, r = cube.axes(style)
    q, b = cube.q, cube.weight
    return Block(((0, g.index * q + b.index, q * q), (1, r.index, q)), ((b, 0), (g, 0), (r, 1)), cube.tp)


class CubeLinear(nn.Module):
    def __init__(self, full: nn.Linear, cube: Cube, style: str, *, gather: bool = False) -> None:
        """gather: the output gathered whole on every rank (the column_gather style)."""
        super().__init__()
        if kernel_of(full) is not dense_linear:
            raise ValueError("the 3d cube's linears multiply densely only (precision fp8 is refused under tp_mode 3d)")
        self.cube, self.style, self.gather = cube, style, gather
        self.output = cube.turned if style == "column" else cube.stream
        self.weight = parameter(full.weight, cube_matrix(cube, style), f"3d {style} weight")
        self.bias = parameter(full.bias, vector_block(self.output), f"3d {style} bias") if full.bias is not None else None

    def blocks(self) -> dict[str, Block]:
        return {"weight": cube_matrix(self.cube, self.style), "bias": vector_block(self.output)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cube_linear(x, self.weight, self.cube, self.style)
        if self.bias is not None:
            y = y + copied(self.bias, self.output.rows).to(y.dtype)
        return gathered(y, self.output) if self.gather else y


class CubeEmbedding(nn.Module):
    refuses_positions = GRID_DOCUMENTS
    """paratrain.nn.documents.refuse_documents reads it: the rows' blocks do not cut the documents' masks yet."""

    def __init__(self, full: nn.Embedding, cube: Cube) -> None:
        super().__init__()
        self.cube = cube
        self.weight = parameter(full.weight, cube_matrix(cube, "column"), "3d embedding")
        self.vocab_start = (cube.input.index * cube.q + cube.weight.index) * self.weight.shape[0]
        self.padding_idx = local_padding(full, self.vocab_start, self.weight.shape[0])
        scale = getattr(full, "embed_scale", None)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)

    def blocks(self) -> dict[str, Block]:
        return {"weight": cube_matrix(self.cube, "column")}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_rows(ids, self.cube.stream.row_parts, "3d embedding")
        rows = lookup(ids, self.weight, self.vocab_start, self.padding_idx, getattr(self, "embed_scale", None))
        rows = reduce_scatter_to_sequence_region(rows, self.cube.weight, 0)  # rows block b, summed over b's vocab
        return reduce_scatter_to_sequence_region(rows, self.cube.input, 0)  # rows block b q + a, summed over a's
