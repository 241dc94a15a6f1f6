"""Who holds which part of every matrix Muon orthogonalises, on every rank of a layout, as the engine lays them out:
what paratrain.optim.exchange plans its all-to-alls from (each rank's `Held` pieces), derived here from the layout
alone, so that the planner runs the exchange's own plan (paratrain.optim.buckets: owners, buckets, their counts)
and prices a Muon step's traffic and buffers per rank to the element.

A rank at (pp, dp, cp, tp) holds the matrices of its pipeline stage (paratrain.planner.params.rank_params, in the
engine's order), each as its tensor-parallel slice or grid block (one part per tp position; a 2.5-D stack's depths
hold the same blocks; tensors tp does not split are whole on every tp rank), an expert bank as its ep rank's experts
(contiguous, ep index = dp mod ep). Without ZeRO it holds those whole; under ZeRO it holds a shard of each of Muon's
flat groups (paratrain.planner.memory.flat_members: the parameters laid end to end, padded to a multiple of the shard
count): the dense groups' shard index (dp mod dp_shard) x cp + cp's index, the experts' (dp // ep) x cp + cp's
(paratrain.topology.mesh's dp_shard and edp groups). Ranks with the same part of a unit are its replicas (one class).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

from paratrain.config.model import ModelConfig
from paratrain.optim.buckets import Classes, Unit, assign_owners, bucket_sizes, bucket_units, peak_elements
from paratrain.optim.exchange import newton_schulz_flops
from paratrain.optim.matrices import unit_shape
from paratrain.pipeline.schedules import Schedule
from paratrain.planner.memory import flat_members, optimizer_group
from paratrain.planner.params import RankParam, rank_params
from paratrain.topology.dims import ParallelDims


@dataclass(frozen=True)
class MatrixLayout:
    """What the exchange's plan depends on: the grid, ZeRO's stage, expert-tp, the pipeline, and the caps (bytes)
    of ZeRO's flat groups and of the exchange's buckets (of ns_bytes-byte elements). No defaults: the planner's
    StepSettings holds them (planner.optimizer builds this from a Layout and its settings)."""

    dims: ParallelDims
    zero: int
    expert_tp: bool
    pipeline: Schedule | None
    pp_split: tuple[int, ...]
    bucket_bytes: int
    ns_bytes: int
    float8: bool
    """ZeRO-3 gathers the float8 linears' weights in groups of their own."""


@dataclass(frozen=True)
class ExchangePlan:
    """The exchange's plan on every rank of the grid (index: the global rank)."""

    numel: tuple[int, ...]
    """Elements of the tensors Muon updates as matrices (MatrixExchange.numel: ZeRO's padding included)."""
    sent: tuple[tuple[int, int], ...]
    """Elements sent per step, (gather, scatter) (MatrixExchange.traffic())."""
    received: tuple[tuple[int, int], ...]
    """Elements received per step, (gather, scatter)."""
    peak: tuple[int, ...]
    """Elements held at the step's peak (MatrixExchange.peak_bytes() / the element size)."""
    owner_flops: tuple[int, ...]
    """Newton-Schulz FLOPs each rank runs as an owner (MatrixExchange.owner_flops)."""
    buckets: int
    largest_flops: int
    """The largest unit's Newton-Schulz FLOPs."""


@functools.lru_cache(maxsize=256)
def exchange_plan(model: ModelConfig, where: MatrixLayout) -> ExchangePlan:
    """The plan MatrixExchange makes for Muon's matrices of `model` laid out as `where` says."""
    dims = where.dims
    world = dims.grid_size
    whole = {p.name: p.shape for p in rank_params(model, ParallelDims(), 0)}
    parts: dict[Unit, dict[tuple, list[int]]] = defaultdict(dict)  # unit -> part -> [ranks..., then its size last]
    numel = []
    for rank in range(world):
        held, n = _rank_parts(model, where, rank)
        numel.append(n)
        for unit, part, count in held:
            entry = parts[unit].setdefault(part, [count])
            if entry[0] != count:
                raise AssertionError(f"{unit}: ranks of one part hold {entry[0]} and {count} elements")
            entry.append(rank)
    units = sorted(parts)
    shapes = {u: unit_shape(whole[u[0]]) for u in units}
    sizes = {u: shapes[u][0] * shapes[u][1] for u in units}
    classes: dict[Unit, Classes] = {u: [(tuple(e[1:]), e[0]) for e in parts[u].values()] for u in units}
    for u in units:
        if sum(n for _, n in classes[u]) != sizes[u]:
            raise AssertionError(f"{u}: the parts cover {sum(n for _, n in classes[u])} of {sizes[u]} elements")
    holders = {u: sorted(r for ranks, _ in classes[u] for r in ranks) for u in units}
    flops = {u: newton_schulz_flops(shapes[u]) for u in units}
    owner, load = assign_owners(units, holders, flops, world)
    buckets = [bucket_sizes(part, classes, owner, sizes, world)
               for part in bucket_units(units, sizes, owner, world, max(1, where.bucket_bytes // where.ns_bytes))]
    per_rank = [[b[r] for b in buckets] for r in range(world)]
    return ExchangePlan(
        numel=tuple(numel),
        sent=tuple((sum(b.sent for b in bs), sum(b.returned for b in bs)) for bs in per_rank),
        received=tuple((sum(b.received for b in bs), sum(b.given for b in bs)) for bs in per_rank),
        peak=tuple(peak_elements(numel[r], per_rank[r], alone=world == 1) for r in range(world)),
        owner_flops=tuple(load), buckets=len(buckets), largest_flops=max(flops.values(), default=0))


@functools.lru_cache(maxsize=4096)
def _rank_parts(model: ModelConfig, where: MatrixLayout,
                rank: int) -> tuple[tuple[tuple[Unit, tuple, int], ...], int]:
    """((unit, which part of it, elements of it held), ...) and the elements of Muon's tensors on `rank`."""
    dims, zero = where.dims, where.zero
    coords = dims.coords(rank)
    pp, dp, tp = coords["pp"], coords["dp"], coords["tp"]
    params = tuple(rank_params(model, dims, pp, where.pp_split, expert_tp=where.expert_tp, pipeline=where.pipeline))
    mine = [i for i, p in enumerate(params) if optimizer_group(p, "muon") == 0]
    place = _tp_part(dims, tp)
    shard, expert_shard = dims.shard_index(coords), dims.expert_shard_index(coords)
    dense_parts, expert_parts = dims.shard_ranks, dims.expert_replicas
    held: list[tuple[Unit, tuple, int]] = []
    if not zero:
        for i in mine:
            p = params[i]
            first, size = _units(p, dims, dp)
            for j in range(_count(p)):
                held.append(((p.name, first + j), (place if p.tp_split else None,), size))
        return tuple(held), sum(params[i].numel for i in mine)
    total = 0
    for members, expert, matrix, _ in flat_members(params, zero == 3, where.bucket_bytes, "muon", where.float8):
        if not matrix:
            continue
        count, index = (expert_parts, expert_shard) if expert else (dense_parts, shard)
        length = math.ceil(sum(params[i].numel for i in members) / count)
        lo, hi = index * length, (index + 1) * length
        total += length
        offset = 0
        for i in members:
            p = params[i]
            first, size = _units(p, dims, dp)
            for j in range(_count(p)):
                start = offset + j * size
                n = min(hi, start + size) - max(lo, start)
                if n > 0:
                    held.append(((p.name, first + j), (place if p.tp_split else None, index), n))
            offset += p.numel
    return tuple(held), total


def _tp_part(dims: ParallelDims, tp: int) -> int:
    """Which part of a tp-split matrix tp rank `tp` holds: its 1-D slice or grid block; a 2.5-D grid's depths
    (tp = depth q^2 + row q + column) hold the same blocks."""
    if dims.tp_depth > 1:  # (tp_depth is 1 in every other mode)
        return tp % dims.grid_side ** 2
    return tp


def _count(p: RankParam) -> int:
    """Units of this rank's tensor: its leading slices (one for a 2-D weight)."""
    return math.prod(p.shape[:-2])


def _units(p: RankParam, dims: ParallelDims, dp: int) -> tuple[int, int]:
    """(the index among the whole tensor's units of this rank's first, elements of each held here): an expert
    bank's experts are the ep rank's contiguous share."""
    local = _count(p)
    first = dims.expert_index(dp) * local if p.expert else 0
    return first, p.numel // local
