"""Expert tensor parallelism: every expert's two matrices split over tp (Megatron-Core's ETP, of degree tp).

Expert e's up projection up[e] [F, D] is cut along F (column-parallel: a tp rank computes F / tp of the
hidden units) and its down projection down[e] [D, F] along F too (row-parallel: a tp rank's output is a
partial sum); the tp ranks' partial outputs are summed. The stacked weights keep their whole names and
are cut along dim 1 (up [E, F, D]) and dim 2 (down [E, D, F]), under expert parallelism within this ep
rank's experts. What the tp ranks hold when rows reach the experts decides the collectives:

- without sequence parallelism every tp rank routed the same tokens alike, so holds the same rows: they
  enter by copy_to_tp_region (identity; in backward their gradient summed over tp) and the outputs leave
  by reduce_from_tp_region (summed over tp), as a dense MLP's (paratrain.comm.regions);
- with sequence parallelism each tp rank routed its own tokens (paratrain.tensor_parallel.sequence): the
  tp group's rows are all-gathered (counts per expert first: they are uneven), each rank runs its slice
  of every expert on all of them, and the partial outputs are reduce-scattered back to the rank each row
  came from; backward runs the conjugates (reduce-scatter of the rows' gradients, all-gather of the
  outputs').

Under expert parallelism the all-to-all over ep runs first (paratrain.expert_parallel.layout: the ranks
of one tp index exchange their rows), then the above inside the receiving rank's tp group.

Gradients: an expert slice's gradient covers every row its tp group ran, so it is reduced as the experts'
(over edp) and never summed over tp; its norm's squares add up over tp (the placement's split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.comm.placement import Placements
from paratrain.comm.regions import (all_gather_along, copy_to_tp_region, gather_from_sequence_region,
                                    reduce_from_tp_region, reduce_scatter_to_sequence_region)
from paratrain.expert_parallel.layout import ExpertLayout, _expert_major
from paratrain.nn.moe import Experts, MoE
from paratrain.state_layout import DimCuts
from paratrain.topology.mesh import AxisGroup, Mesh

CUT_DIMS = {"up": 1, "down": 2}
"""The dim of each stacked expert weight that expert tensor parallelism cuts (the hidden width F)."""


class TensorParallelExperts(Experts):
    """This tp rank's slice of every expert (up[:, F/tp], down[:, :, F/tp]); forward sums over tp."""

    def __init__(self, whole: Experts, group: AxisGroup, *, rows_differ: bool) -> None:
        nn.Module.__init__(self)
        self.group, self.rows_differ = group, rows_differ
        for attr, dim in CUT_DIMS.items():
            full = getattr(whole, attr)
            size = full.shape[dim]
            if size % group.size:
                raise ValueError(f"expert tensor parallelism cuts the experts' width ({size}) over tp = {group.size}: "
                                 "it must divide; set d_expert to a multiple of tp, or drop --expert-tp")
            part = size // group.size
            piece = full.detach().narrow(dim, group.index * part, part).clone()
            setattr(self, attr, nn.Parameter(piece, requires_grad=full.requires_grad))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if not self.rows_differ:
            if not rows.shape[0]:  # the same on every tp rank: none of them enters a collective
                return rows[:0]
            return reduce_from_tp_region(super().forward(copy_to_tp_region(rows, self.group), counts), self.group)
        everyone = all_gather_along(torch.tensor(counts, dtype=torch.int64, device=rows.device), self.group, 0)
        matrix = ([list(counts)] * self.group.size if rows.is_meta  # the dry run: every tp rank routed alike
                  else everyone.view(self.group.size, len(counts)).tolist())  # [tp rank][expert]: its rows
        sizes = [sum(row) for row in matrix]
        longest = max(sizes)
        if not longest:  # no tp rank has a row: none enters the collectives below
            return rows[:0]
        # all-gather rows padded to the longest, keep the real ones (by source rank, then expert)
        padded = F.pad(rows, (0, 0, 0, longest - rows.shape[0]))
        real = torch.cat([torch.arange(r * longest, r * longest + n, device=rows.device) for r, n in enumerate(sizes)])
        gathered = gather_from_sequence_region(padded, self.group, 0).index_select(0, real)
        by_expert = _expert_major(matrix, device=rows.device)
        out = super().forward(gathered[by_expert], [sum(row[e] for row in matrix) for e in range(len(counts))])
        by_source = torch.zeros_like(out).index_copy(0, by_expert, out)
        partial = by_source.new_zeros(self.group.size * longest, by_source.shape[1]).index_copy(0, real, by_source)
        return reduce_scatter_to_sequence_region(partial, self.group, 0)[: rows.shape[0]]


@dataclass
class ExpertTensorLayout(DimCuts):
    """What apply_expert_tensor_parallel did: the expert weights it cut, along which dim, over tp."""

    experts: ExpertLayout | None = None
    """Expert parallelism's layout, when the experts are also shared out over ep (their placement is its)."""

    def place(self, placements: Placements, mesh: Mesh) -> None:
        """Reduced as the experts are (over edp under expert parallelism, else as the dense parameters), their
        norm adding up over tp. The kind is added on every rank, with experts here or not (a pipeline stage
        without a MoE layer): every rank's norm then issues the same collectives."""
        base = placements.default
        if self.experts is not None:
            base = self.experts.placement(base, mesh.expert_data_group())
        placements.add(base.split_over(self.group), self.split_ids)


def apply_expert_tensor_parallel(model: nn.Module, group: AxisGroup, *, rows_differ: bool) -> ExpertTensorLayout:
    """Cut every MoE layer's experts of `model` over the tp `group` (after expert parallelism, if any, kept
    this rank's experts). rows_differ: sequence parallelism (each tp rank routed its own tokens)."""
    layout = ExpertTensorLayout(group)
    ids = set()
    for module_name, module in model.named_modules():
        if isinstance(module, MoE):
            module.experts = TensorParallelExperts(module.experts, group, rows_differ=rows_differ)
            for attr, dim in CUT_DIMS.items():
                layout.split_dims[f"{module_name}.experts.{attr}"] = dim
                ids.add(id(getattr(module.experts, attr)))
    layout.split_ids = frozenset(ids)
    return layout
