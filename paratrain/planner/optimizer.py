"""What a matrix optimizer adds to a step (paratrain.optim.Muon under paratrain.optim.exchange): each unit matrix's
Newton-Schulz on its owner, and the all-to-alls that bring the matrix to it and its update back.

The planner runs the exchange's own plan (paratrain.planner.matrix_holders: every rank's parts of every matrix, as
the layout places them; paratrain.optim.buckets: the owners, balanced by Newton-Schulz FLOPs, and the buckets), so
the elements each rank sends and receives, the FLOPs it runs as an owner and the buffers it holds at the step's
peak are the engine's to the element (tests/distributed/test_muon.py compares them rank by rank). In aggregate,
per pipeline stage with M matrix elements held by its R ranks, each element cut S ways (tp slices x ZeRO shards) and
held by r = R / S replicas: the gathers move M (S - 1) / S elements and the scatters M (r - 1 / S), about
M (S (1 + r) - 2) / (S R) a rank, in the Newton-Schulz dtype (bfloat16: 2 bytes).

Time: the exchange runs in n buckets (bucket_mb of elements each), the next bucket's gather and the previous one's
scatter in flight while the owners map one, so the step is exposed for the larger of the busiest owner's
Newton-Schulz and the busiest rank's exchange (the larger of what it sends and receives, over one bandwidth), plus
the smaller's share of one bucket (the pipeline's fill and drain). Memory: the rank's matrix elements twice (the
update inputs, and the exchange's copy it gathers from and writes the results over) and, at the worst bucket, its
owned units and up to three buckets' messages (paratrain.optim.buckets.peak_elements).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

from paratrain.config.model import ModelConfig
from paratrain.optim import is_matrix, newton_schulz_flops
from paratrain.optim.buckets import BucketSizes, bucket_units, peak_elements
from paratrain.optim.matrices import unit_shape
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.matrix_holders import ExchangePlan, MatrixLayout, exchange_plan
from paratrain.planner.memory import optimizer_group
from paratrain.planner.params import rank_params
from paratrain.planner.settings import StepSettings
from paratrain.topology.dims import ParallelDims

NS_BYTES = {"bf16": 2, "fp32": 4, "fp64": 8}
"""Bytes of an element in each Newton-Schulz dtype (OptimSection.muon_ns_dtype; bfloat16 is torch's and the default),
what the exchange moves."""


@functools.lru_cache(maxsize=64)
def matrix_units(model: ModelConfig) -> tuple[tuple[int, int], ...]:
    """Every unit matrix Muon orthogonalises in the whole model (a stacked expert weight's slices each one)."""
    units = []
    for p in rank_params(model, ParallelDims(), 0):
        if is_matrix(p.name, p.shape):
            units += [(p.shape[-2], p.shape[-1])] * math.prod(p.shape[:-2])
    return tuple(units)


@dataclass(frozen=True)
class ExchangeFigures:
    """A Muon step's matrix part on the busiest ranks."""

    peak: dict[int, int]
    """Elements held at the step's peak, the fullest rank of each pipeline stage."""
    owner_flops: int
    """Newton-Schulz FLOPs of the busiest owner."""
    moved: int
    """Elements the busiest rank sends or receives (the larger) per step."""
    buckets: int
    exact: bool
    """The exchange's own plan (paratrain.planner.matrix_holders), or the search's estimate of it."""


def layout_exchange(model: ModelConfig, layout: Layout, settings: StepSettings) -> ExchangePlan:
    """The exchange's plan for Muon on `layout` under `settings` (its flat groups, buckets and Newton-Schulz dtype)."""
    return exchange_plan(model, _matrix_layout(layout, settings))


def _matrix_layout(layout: Layout, settings: StepSettings) -> MatrixLayout:
    return MatrixLayout(layout.dims, zero=layout.zero, expert_tp=layout.expert_tp, pipeline=layout.pipeline,
                        pp_split=tuple(settings.pp_split), bucket_bytes=int(settings.bucket_mb * 2**20),
                        ns_bytes=NS_BYTES[settings.muon_ns_dtype], float8=settings.float8_gathers(layout))


def exchange_figures(model: ModelConfig, layout: Layout, settings: StepSettings, *, exact: bool = True) -> ExchangeFigures:
    """The busiest ranks' figures: from the exchange's plan (exact), or estimated (what the search ranks its many
    layouts by: the plan takes about a second on a thousand ranks)."""
    if not exact:
        return _estimate(model, _matrix_layout(layout, settings))
    plan = layout_exchange(model, layout, settings)
    dims = layout.dims
    stages = [dims.coords(r)["pp"] for r in range(dims.grid_size)]
    peak: dict[int, int] = {}
    for rank, stage in enumerate(stages):
        peak[stage] = max(peak.get(stage, 0), plan.peak[rank])
    moved = max(max(sum(s), sum(r)) for s, r in zip(plan.sent, plan.received))
    return ExchangeFigures(peak, max(plan.owner_flops), moved, plan.buckets, True)


@functools.lru_cache(maxsize=4096)
def _estimate(model: ModelConfig, where: MatrixLayout) -> ExchangeFigures:
    """The exchange's plan on one stage of identical ranks: each of the R ranks holds 1 / S of every unit (S = tp x
    ZeRO's shards), r = R / S replicas of each piece; the stage's units go to owners largest first (the least
    loaded rank) and into buckets as the exchange cuts them (paratrain.optim.buckets); in a bucket of T elements of
    which the busiest owner owns o, a rank sends T (S - 1) / (S R) and gets (T - o) / S back as a holder, and as an
    owner receives o (S - 1) / S and returns o (r - 1 / S). tests/unit/test_muon_plan.py measures it against the
    plan: the peak within 0.9-1.25x, the busiest owner's FLOPs 0.8-1.3x."""
    dims, zero = where.dims, where.zero
    whole = {p.name: p.shape for p in rank_params(model, ParallelDims(), 0)}
    units: list[tuple[str, int]] = []
    for p in rank_params(model, dims, 0, where.pp_split, expert_tp=where.expert_tp, pipeline=where.pipeline):
        if optimizer_group(p, "muon") == 0:
            units += [(p.name, j) for j in range(math.prod(whole[p.name][:-2]))]
    shape = {u: unit_shape(whole[u[0]]) for u in units}
    sizes = {u: shape[u][0] * shape[u][1] for u in units}
    ranks = dims.grid_size // dims.pp
    split = dims.tp * (dims.shard_ranks if zero else 1)
    replicas = ranks / split
    flops = {u: newton_schulz_flops(shape[u]) for u in units}
    heap = [(0, r) for r in range(ranks)]  # every rank holds every unit: longest processing time first
    owner: dict[tuple[str, int], int] = {}
    for u in sorted(units, key=lambda u: (-flops[u], u)):
        least, r = heapq.heappop(heap)
        owner[u] = r
        heapq.heappush(heap, (least + flops[u], r))
    load = [least for least, _ in heap]
    element = max(1, where.bucket_bytes // where.ns_bytes)
    figures = []
    for bucket in bucket_units(sorted(units), sizes, owner, ranks, element):
        total = sum(sizes[u] for u in bucket)
        owned = [0] * ranks
        for u in bucket:
            owned[owner[u]] += sizes[u]
        o = max(owned)
        if ranks == 1:
            figures.append(BucketSizes(owned=o))
            continue
        figures.append(BucketSizes(owned=o, sent=total * (split - 1) // (split * ranks), given=(total - o) // split,
                                   received=o * (split - 1) // split, returned=int(o * (replicas - 1 / split))))
    numel = sum(sizes.values()) // split
    peak = peak_elements(numel, figures, alone=ranks == 1)
    moved = sum(max(b.sent + b.returned, b.received + b.given) for b in figures)
    return ExchangeFigures({s: peak for s in range(dims.pp)}, max(load, default=0), moved, len(figures), False)


def muon_seconds(model: ModelConfig, layout: Layout, hw: Hardware, settings: StepSettings, *,
                 exact: bool = True) -> dict[str, float]:
    """{"newton-schulz", "exchange"}: seconds of the busiest rank's Muon step beyond an element-wise optimizer's."""
    if not matrix_units(model):
        return {"newton-schulz": 0.0, "exchange": 0.0}
    figures = exchange_figures(model, layout, settings, exact=exact)
    compute = figures.owner_flops / (hw.peak_flops * hw.efficiency)
    ranks = layout.dims.grid_size // layout.pp
    if ranks == 1:
        return {"newton-schulz": compute, "exchange": 0.0}
    bandwidth = hw.intra_node_bw if ranks <= hw.devices_per_node else hw.inter_node_bw
    exchange = 2 * figures.buckets * hw.latency_s + figures.moved * NS_BYTES[settings.muon_ns_dtype] / bandwidth
    exposed = max(compute, exchange) + min(compute, exchange) / figures.buckets  # pipelined by bucket
    return {"newton-schulz": compute, "exchange": exposed - compute}


def exchange_bytes(model: ModelConfig, layout: Layout, *, stage: int, settings: StepSettings,
                   exact: bool = True) -> int:
    """Bytes a Muon step's matrix part holds at its peak on the fullest rank of pipeline stage `stage`
    (paratrain.optim.MatrixExchange.peak_bytes, from the same plan; or the search's estimate)."""
    if not matrix_units(model):
        return 0
    return exchange_figures(model, layout, settings, exact=exact).peak[stage] * NS_BYTES[settings.muon_ns_dtype]
