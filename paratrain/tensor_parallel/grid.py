"""The 2D tensor-parallel grid: tp = q x q ranks, each holding one block of every weight and activation.

The tp ranks of one group are laid out row by row (tp_index = i * q + j); rank (i, j) holds

    activations  X[B, S, h]   -> X[B_i, S, h_j]       the batch rows' block i, the hidden width's block j
    weights      W[out, in]   -> W[out_i, in_j]       torch's Linear layout: output block i, input block j
    embeddings   E[V, h]      -> E[V_i, h_j]          the same cut, so a head tied to the embedding stays one
    vectors      b[out], g[h] -> b[out_j]             replicated down the column (over i)

Two sub-axes connect them (paratrain.topology.mesh builds both groups):

    row  "tp_row"   ranks (i, 0) .. (i, q-1): a row's blocks of one activation; its index is j
    col  "tp_col"   ranks (0, j) .. (q-1, j): a column's blocks of one weight; its index is i

Optimus (Xu et al. 2021, arXiv 2104.05343) splits the activations the same way; SUMMA (van de Geijn and Watts
1997) multiplies such blocks with q broadcasts per operand (paratrain.tensor_parallel.summa).

2.5D (Tesseract, Wang et al. 2021, arXiv 2105.14500) stacks d such grids, tp = d q^2, tp_index = k q^2 + i q + j:
grid k holds the same weight blocks and runs on its own share of every micro-batch, rows block k q + i of d q on
rank (k, i, j). A third sub-axis, "tp_depth" (ranks (0, i, j) .. (d-1, i, j), index k), sums the weight gradients
over the stack inside each layer's backward, so what leaves a layer is the whole micro-batch's gradient, as under 2D;
d = 1 is the 2D layout exactly. (Colossal-AI's 2.5D split neither the batch over depth nor summed over it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.topology.mesh import AxisGroup, Mesh

Cut = tuple[int, int, int]
"""(dim, index, parts): block `index` of `parts` equal blocks along `dim` (paratrain.hybrid.pieces)."""


@dataclass(frozen=True)
class Block:
    """How a grid (or cube) layer's parameter is cut, made whole, counted and saved: what its layout reports."""

    cuts: tuple[Cut, ...]
    """This rank's block of the whole tensor, one cut per split dim."""
    gathers: tuple[tuple[AxisGroup, int], ...]
    """The (group, dim) all-gathers, in order, that make the whole tensor from the blocks."""
    split: AxisGroup
    """The ranks holding different blocks of it: the gradient norm's squares add up over them."""
    copies: tuple[AxisGroup, ...] = ()
    """The groups whose other ranks hold the same block (its gradient is summed over them inside the layer): only
    their first rank saves it."""
    counted: bool = True
    """False: a copy on another rank counts it in the gradient norm (2.5d: grid 0's)."""


@dataclass(frozen=True)
class Activations:
    """Where a layout keeps an activation [B, S, h]: its width cut along one group, its rows in blocks over others."""

    width: AxisGroup
    """Cuts h: a norm's statistics are summed over it; a vector's block is this group's index."""
    rows: tuple[AxisGroup, ...]
    """Cut the micro-batch's rows, innermost first: block sum_n rows[n].index x prod_{m < n} rows[m].size. These
    ranks hold the same block of a vector along h (its gradient summed over them)."""

    @property
    def row_parts(self) -> int:
        return math.prod(group.size for group in self.rows)

    @property
    def row_block(self) -> int:
        block, stride = 0, 1
        for group in self.rows:
            block, stride = block + group.index * stride, stride * group.size
        return block


@dataclass(frozen=True)
class Grid:
    row: AxisGroup
    """The ranks of this rank's grid row (same i); index j."""
    col: AxisGroup
    """The ranks of this rank's grid column (same j); index i."""
    tp: AxisGroup
    """Every rank of the tp group (d q^2): a matrix's blocks add up over it in the gradient norm (each counted on
    depth 0 only under 2.5d)."""
    depth: AxisGroup | None = None
    """2.5d: the ranks at this grid position of every stacked grid (same i, j); index k. None: one grid."""

    @classmethod
    def of(cls, mesh: Mesh) -> Grid:
        missing = [axis for axis in ("tp", "tp_row", "tp_col") if axis not in mesh.groups]
        if missing:
            raise ValueError(f"the mesh has no {', '.join(missing)} group: a grid needs dims with tp_mode '2d' or "
                             f"'2.5d' and tp = d x q x q, q >= 2 (tp is {mesh.dims.tp}, tp_mode {mesh.dims.tp_mode!r})")
        return cls(row=mesh.groups["tp_row"], col=mesh.groups["tp_col"], tp=mesh.groups["tp"],
                   depth=mesh.groups.get("tp_depth"))

    @property
    def q(self) -> int:
        return self.row.size

    @property
    def i(self) -> int:
        """This rank's grid row: its block of the batch rows and of a weight's output dim."""
        return self.col.index

    @property
    def j(self) -> int:
        """This rank's grid column: its block of the hidden width and of a weight's input dim."""
        return self.row.index

    @property
    def d(self) -> int:
        return self.depth.size if self.depth is not None else 1

    @property
    def k(self) -> int:
        """This rank's grid in the stack (2.5d; 0 with one grid)."""
        return self.depth.index if self.depth is not None else 0

    @property
    def stream(self) -> Activations:
        """Every activation's layout: the width along the row, the rows down the column, then over depth (block
        k q + i of d q)."""
        return Activations(self.row, (self.col,) if self.depth is None else (self.col, self.depth))
