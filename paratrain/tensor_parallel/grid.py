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
    """The whole grid (q^2 ranks): what a block split two ways is split over."""

    @classmethod
    def of(cls, mesh: Mesh) -> Grid:
        missing = [axis for axis in ("tp", "tp_row", "tp_col") if axis not in mesh.groups]
        if missing:
            raise ValueError(f"the mesh has no {', '.join(missing)} group: a 2d grid needs dims with tp_mode '2d' "
                             f"and tp = q x q >= 4 (tp is {mesh.dims.tp}, tp_mode {mesh.dims.tp_mode!r})")
        return cls(row=mesh.groups["tp_row"], col=mesh.groups["tp_col"], tp=mesh.groups["tp"])

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
