"""The parameter elements a rank holds, for the step time's terms (paratrain.planner.timing): the busiest pipeline
rank's, with tp's, the grids' and ep's slices taken, split by what ZeRO-3 gathers them as and where they are reduced;
and the elements its optimizer steps."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paratrain.config.model import ModelConfig
from paratrain.pipeline.schedules import Schedule
from paratrain.planner.layout import Layout
from paratrain.planner.params import rank_params
from paratrain.topology.dims import ParallelDims


@dataclass(frozen=True)
class Held:
    """Parameter elements of the busiest pipeline rank (first or last stage), tp's, the grids' (2.5d: numel x depth
    / tp) and ep's slices taken."""
    total: int
    root: int
    """The embedding, final norm and head: ZeRO-3's root unit (the rest are the blocks' units)."""
    expert: int
    """The MoE layers' experts (this rank's E / ep), reduced and sharded over their dp / ep replicas."""
    linear: int
    """The blocks' linear weights (what ZeRO-3 gathers in float8 under fp8, tensorwise)."""


@functools.lru_cache(maxsize=4096)
def _held(model: ModelConfig, dims: ParallelDims, expert_tp: bool, pipeline: Schedule | None) -> Held:
    held = []
    for stage in {0, dims.pp - 1}:
        params = rank_params(model, dims, stage, expert_tp=expert_tp, pipeline=pipeline)
        held.append(Held(sum(p.numel for p in params), sum(p.numel for p in params if not p.unit),
                          sum(p.numel for p in params if p.expert), sum(p.numel for p in params if p.block_linear)))
    return max(held, key=lambda h: h.total)


def rank_held(model: ModelConfig, layout: Layout) -> Held:
    return _sliced_held(model, layout.dims, layout.expert_tp, layout.pipeline)


@functools.lru_cache(maxsize=4096)
def _sliced_held(model: ModelConfig, dims: ParallelDims, expert_tp: bool, pipeline: Schedule | None) -> Held:
    return _held(model, dims.parameter_slices(), expert_tp, pipeline)


def stepped_elements(model: ModelConfig, layout: Layout) -> float:
    """Parameter elements this rank's optimizer steps: its ZeRO shard (the experts' over their own replicas)."""
    if layout.offload or layout.ps_mode != "off":  # the optimizer runs on the host, or on the servers
        return 0.0
    held = rank_held(model, layout)
    if not layout.zero:
        return float(held.total)
    return (held.total - held.expert) / layout.shards + held.expert / layout.expert_shards
