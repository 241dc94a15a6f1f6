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

from dataclasses import dataclass

from paratrain.topology.mesh import AxisGroup, Mesh


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
    def row_parts(self) -> int:
        """The blocks a micro-batch's rows are cut into: d q (the stacked grids' shares, each cut over its rows)."""
        return self.d * self.q

    @property
    def row_block(self) -> int:
        """This rank's block of the micro-batch's rows: grid k's share, then row i of it."""
        return self.k * self.q + self.i

    @property
    def copies(self) -> tuple[AxisGroup, ...]:
        """The groups holding the same block of a vector (a bias, a norm's weight): down the column, and over depth."""
        return (self.col,) if self.depth is None else (self.col, self.depth)
