"""Expert parallelism on the ep axis (a sub-axis of dp).

Within each group of ep consecutive dp ranks, rank i keeps experts [i E/ep, (i + 1) E/ep) of every
MoE layer: the stacked expert weights (paratrain.nn.moe.Experts) sliced along dim 0, under their
whole names. Everything else, the router included, stays replicated and data-parallel over dp, and
every rank routes its own tokens. Then each MoE layer (AllToAllExperts):

  1. exchanges how many rows it sends to each expert (an all-to-all of E integers), so every rank
     knows what it receives: the splits are uneven (dropless routing balances nothing);
  2. sends each row to the rank that holds its expert (all-to-all, rows grouped by expert);
  3. runs its experts on what it received, grouped by expert;
  4. sends the outputs back by the reverse all-to-all, to their rows' places.

Backward runs the two row all-to-alls the other way (AllToAll's autograd). A row's output does not
depend on where its expert ran, and the layer adds a token's k outputs in the order of its choices:
the model is the single-process one (paratrain.nn.moe), whatever ep.

Gradients: an expert's gradient sums over the tokens of its ep group (the all-to-all brought them);
the dp / ep ranks holding the same experts (the "edp" group; under context parallelism times the cp
ranks, "edp_cp") sum it over the rest of the global batch.
The gradient norm adds the experts' squares over ep (each rank holds other experts).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from paratrain.comm import all_to_all
from paratrain.comm.placement import Placement, Placements
from paratrain.comm.regions import all_gather_along
from paratrain.nn.moe import Experts, MoE, balanced
from paratrain.nn.recipe import ExpertBank
from paratrain.state_layout import ModelState, OptimizerState, per_element
from paratrain.topology.mesh import AxisGroup, Mesh


class AllToAll(torch.autograd.Function):
    """Rows to the group's ranks by `send` counts, `receive` counts back; backward the reverse."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: AxisGroup, receive: list[int], send: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.receive, ctx.send = group, receive, send
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        all_to_all(out, rows.contiguous(), group, output_splits=receive, input_splits=send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), ctx.group, output_splits=ctx.send, input_splits=ctx.receive)
        return back, None, None, None


@dataclass(frozen=True)
class AllToAllExperts:
    """A MoE layer's ExpertRunner under expert parallelism (steps 1-4 of the module docstring)."""

    group: AxisGroup
    n_experts: int

    def __call__(self, rows: torch.Tensor, expert_ids: torch.Tensor, experts: Experts) -> torch.Tensor:
        ep, local = self.group.size, self.n_experts // self.group.size
        if rows.is_meta:  # the planner's dry run has no ids to route by: even, each rank receiving what it sends,
            return self._balanced(rows, experts, local)  # through the same exchanges, gathers and copies
        order = torch.argsort(expert_ids, stable=True)  # grouped by expert, so by destination rank
        per_expert = torch.bincount(expert_ids, minlength=self.n_experts)
        incoming = torch.empty_like(per_expert)
        all_to_all(incoming, per_expert, self.group, output_splits=[local] * ep, input_splits=[local] * ep)
        matrix = incoming.view(ep, local).tolist()  # [source rank][local expert]: rows received
        send = per_expert.view(ep, local).sum(dim=1).tolist()
        receive = [sum(row) for row in matrix]
        arrived = AllToAll.apply(rows[order], self.group, receive, send)  # by source, then expert
        by_expert = _expert_major(matrix, device=rows.device)
        out = experts(arrived[by_expert], [sum(matrix[s][e] for s in range(ep)) for e in range(local)])
        back = torch.empty_like(out).index_copy_(0, by_expert, out)  # by source again
        returned = AllToAll.apply(back, self.group, send, receive)
        return torch.empty_like(returned).index_copy_(0, order, returned)

    def _balanced(self, rows: torch.Tensor, experts: Experts, local: int) -> torch.Tensor:
        """The dry run's dispatch: the counts exchanged, every rank sending an even share of its rows to each and
        receiving as many (balanced routing), run over this rank's experts evenly, and sent back: the collectives,
        gathers and copies of the real exchange (what it moves and what autograd saves)."""
        ep = self.group.size
        per_expert = torch.zeros(self.n_experts, dtype=torch.long, device=rows.device)
        incoming = torch.empty_like(per_expert)
        all_to_all(incoming, per_expert, self.group, output_splits=[local] * ep, input_splits=[local] * ep)
        order = torch.arange(rows.shape[0], device=rows.device)
        even = balanced(rows.shape[0], ep)
        arrived = AllToAll.apply(rows[order], self.group, even, even)
        by_expert = torch.arange(arrived.shape[0], device=rows.device)
        out = experts(arrived[by_expert], balanced(arrived.shape[0], local))
        back = torch.empty_like(out).index_copy_(0, by_expert, out)
        returned = AllToAll.apply(back, self.group, even, even)
        return torch.empty_like(returned).index_copy_(0, order, returned)


def _expert_major(matrix: list[list[int]], *, device: torch.device) -> torch.Tensor:
    """Indices that reorder rows laid out by source then expert into expert then source."""
    starts, offset = [], 0
    for counts in matrix:
        starts.append([])
        for n in counts:
            starts[-1].append(offset)
            offset += n
    pieces = [torch.arange(starts[s][e], starts[s][e] + matrix[s][e], device=device)
              for e in range(len(matrix[0]) if matrix else 0) for s in range(len(matrix))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


@dataclass
class ExpertLayout:
    """What apply_expert_parallel did: the expert weights it sliced, over which group."""

    group: AxisGroup
    names: frozenset[str] = frozenset()
    """Local names of the sliced expert weights (split along dim 0)."""
    ids: frozenset[int] = frozenset()
    """id() of the same parameters."""
    splits: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """name -> (dim, index, parts) of each slice (paratrain.hybrid.pieces.Piece.split)."""

    @property
    def tied(self) -> dict[str, str]:
        return {}

    def place(self, placements: Placements, mesh: Mesh) -> None:
        placements.add(self.placement(placements.default, mesh.expert_data_group()), self.ids)

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]:
        """This rank's experts -> every expert, model and per-element optimizer state (collective over ep)."""
        return self.gather_full(model), per_element(optimizer, self.full)

    def placement(self, dense: Placement, edp: AxisGroup | None) -> Placement:
        """Where the experts' gradients go, from the dense parameters' placement: summed and ZeRO-sharded
        over edp (the ranks holding the same experts, times cp under context parallelism; None when one
        rank holds them), their norm adding up over ep too."""
        return dataclasses.replace(dense, reduce=edp, shard=edp, replicate=None).split_over(self.group)

    def full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of `name` (or state shaped like it) from this rank's experts (collective over ep)."""
        return all_gather_along(tensor.detach(), self.group, 0) if name in self.names else tensor

    def gather_full(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.full(name, state[name]) for name in sorted(state)}


def moe_banks(model: nn.Module) -> list[ExpertBank]:
    """paratrain's own MoE layers (paratrain.nn.moe.MoE) as ExpertBanks."""
    return [ExpertBank(f"{name}.experts", ("up", "down"), module.router.n_experts, module.run_with)
            for name, module in model.named_modules() if isinstance(module, MoE)]


def apply_expert_parallel(model: nn.Module, group: AxisGroup, banks: list[ExpertBank] | None = None) -> ExpertLayout:
    """Keep this ep rank's experts of every MoE layer of `model` (its `banks`; default: paratrain's MoE layers) and
    route their rows through AllToAllExperts."""
    names, ids, splits = set(), set(), {}
    for bank in moe_banks(model) if banks is None else banks:
        if bank.n_experts % group.size:
            raise ValueError(f"{bank.owner}: {bank.n_experts} experts do not divide over ep = {group.size}")
        local = bank.n_experts // group.size
        owner = model.get_submodule(bank.owner)
        for attr in bank.weights:
            piece = getattr(owner, attr)  # cut in place: the parameter stays the same object, so a
            piece.data = piece.detach().narrow(0, group.index * local, local).clone()  # cut over tp keeps its id
            name = f"{bank.owner}.{attr}"
            names.add(name)
            ids.add(id(piece))
            splits[name] = (0, group.index, group.size)
        bank.route(AllToAllExperts(group, bank.n_experts))
    return ExpertLayout(group, frozenset(names), frozenset(ids), splits)
