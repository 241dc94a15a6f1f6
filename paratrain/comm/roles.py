"""What the other parallel axes mean for the gradients a data-parallel strategy holds.

A gradient strategy (GradSync, ZeroSync) reduces gradients over dp. Tensor and pipeline parallelism
add three facts about each parameter, which it needs for the norm and for one extra reduction:

- split over tp: the rank holds a slice, the other tp ranks the other slices (norms add up over tp);
  otherwise it is a replica, identical on every tp rank (counted once);
- on a pipeline stage: other stages hold other parameters (norms add up over pp);
- tied across stages (the GPT's embedding on the first stage and its head copy on the last): the
  two gradients are summed over the `tied` group after the dp reduction, and only one end counts in
  the norm;
- an expert of a MoE layer under expert parallelism: reduced over `edp` (the dp ranks holding the
  same experts) instead of dp, and its squares add up over `ep` (the other ranks hold other experts).

Strategies keep parameters of different roles in different buckets / flat groups, so each bucket
has one role.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class GradRoles:
    tp: AxisGroup | None = None
    tp_split: frozenset[int] = frozenset()
    """id() of parameters split over tp."""
    pp: AxisGroup | None = None
    tied: AxisGroup | None = None
    """The ranks holding the two ends of a tied weight (first and last stage, same dp and tp index)."""
    tied_ids: frozenset[int] = frozenset()
    """id() of this rank's end of a tied weight."""
    norm_skip: frozenset[int] = frozenset()
    """id() of parameters another rank counts in the norm (the last stage's tied copy)."""
    ep: AxisGroup | None = None
    edp: AxisGroup | None = None
    """The ranks holding the same experts (None: dp = ep, no one else holds them)."""
    expert_ids: frozenset[int] = frozenset()
    """id() of expert weights sliced over ep."""

    def bucket_key(self, param: torch.Tensor) -> tuple[bool, bool, bool, bool]:
        """Parameters with different keys never share a bucket or flat group."""
        return (id(param) in self.tp_split, id(param) in self.tied_ids, id(param) in self.norm_skip,
                id(param) in self.expert_ids)

    def reduce_group(self, param: torch.Tensor, dp: AxisGroup | None) -> AxisGroup | None:
        """The group this parameter's gradient is summed over: dp, or edp for an expert."""
        return self.edp if id(param) in self.expert_ids else dp

    def is_tied(self, param: torch.Tensor) -> bool:
        return id(param) in self.tied_ids

    def norm_axes(self, param: torch.Tensor, sharded: tuple[AxisGroup, ...] = ()) -> tuple[AxisGroup, ...] | None:
        """Axes across which ranks hold different pieces of this parameter's gradient (its squares add
        up over them), given the axes the strategy shards it over; None: not counted on this rank."""
        if id(param) in self.norm_skip:
            return None
        if id(param) in self.expert_ids:
            return self._expert_axes(sharded)
        return self._axes(sharded, split=self.tp is not None and id(param) in self.tp_split)

    def norm_part_axes(self, sharded: tuple[AxisGroup, ...] = (),
                       expert_sharded: tuple[AxisGroup, ...] | None = None) -> list[tuple[AxisGroup, ...]]:
        """The axes of every part of the norm, in one order on every rank: tp slices first, then
        replicas, then experts. Every rank reduces every part, holding gradients of it or not: a pipeline stage with
        only the embedding (tp slices) or only the final norm and head (a replica and a skipped tied
        copy) must issue the same collectives as the others, in the same order. expert_sharded: the
        axes experts are sharded over, when not `sharded` (ZeRO shards them over edp)."""
        parts = [self._axes(sharded, split=False)] if self.tp is None else [self._axes(sharded, split=True),
                                                                            self._axes(sharded, split=False)]
        experts = sharded if expert_sharded is None else expert_sharded
        return parts + ([self._expert_axes(experts)] if self.ep is not None else [])

    def _expert_axes(self, sharded: tuple[AxisGroup, ...]) -> tuple[AxisGroup, ...]:
        assert self.ep is not None
        return sharded + (self.ep,) + ((self.pp,) if self.pp is not None else ())

    def _axes(self, sharded: tuple[AxisGroup, ...], *, split: bool) -> tuple[AxisGroup, ...]:
        tp = (self.tp,) if split and self.tp is not None else ()
        return sharded + tp + ((self.pp,) if self.pp is not None else ())
