"""What a matrix optimizer adds to a step (paratrain.optim.Muon under paratrain.optim.exchange): each unit matrix's
Newton-Schulz on its owner, and the all-to-alls that bring the matrix to it and its update back.

Per pipeline stage with M matrix elements held by its R ranks (experts: the ranks holding them), each element cut
S ways (tp slices x ZeRO shards, 1 for replicas) and held by r = R / S replicas, the owners balanced by FLOPs:

    Newton-Schulz   max(F / R, the largest unit's) FLOPs per rank, F = sum over units of steps (4 m^2 n + 2 m^3)
    gather          M (S - 1) / S elements leave their holders (each once), R ranks sending
    scatter         M (r - 1 / S) elements reach holders other than the owner

so a rank moves about M (S (1 + r) - 2) / (S R) elements in the optimizer's Newton-Schulz dtype (bfloat16: 2
bytes). tests/distributed/test_muon.py checks the exchange's element counts on dp 2, tp 2 and ZeRO-1 against the
per-unit terms exactly; this aggregate is an estimate (owners' balance, one bandwidth for the all-to-all).

The exchange runs in n buckets of B = bucket_mb elements' worth (paratrain.optim.exchange), the next bucket's gather
and the previous one's scatter in flight while the owners map one: the step is exposed for the larger of the
Newton-Schulz and the exchange, plus the smaller's share of one bucket (the pipeline's fill and drain). In memory it
holds the rank's matrix elements twice (the update inputs, and the exchange's copy it gathers from and writes the
results over), and at the worst bucket its owned units and up to three buckets' messages (`exchange_elements`; an
estimate: who owns what is balanced by FLOPs, not elements).
"""

from __future__ import annotations

import functools
import math

from paratrain.config.model import ModelConfig
from paratrain.optim import is_matrix, newton_schulz_flops
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.params import rank_params
from paratrain.topology.dims import ParallelDims

NS_BYTES = 2
"""bfloat16: what Muon's Newton-Schulz runs in by default, and so what its exchange moves."""


@functools.lru_cache(maxsize=64)
def matrix_units(model: ModelConfig) -> tuple[tuple[int, int], ...]:
    """Every unit matrix Muon orthogonalises in the whole model (a stacked expert weight's slices each one)."""
    units = []
    for p in rank_params(model, ParallelDims(), 0):
        if is_matrix(p.name, p.shape):
            count = 1
            for d in p.shape[:-2]:
                count *= d
            units += [(p.shape[-2], p.shape[-1])] * count
    return tuple(units)


def muon_seconds(model: ModelConfig, layout: Layout, hw: Hardware, *, bucket_mb: float = 25.0) -> dict[str, float]:
    """{"newton-schulz", "exchange"}: seconds of the busiest rank's Muon step beyond an element-wise optimizer's."""
    units = matrix_units(model)
    if not units:
        return {"newton-schulz": 0.0, "exchange": 0.0}
    per_stage = 1.0 / layout.pp
    flops = sum(newton_schulz_flops(u) for u in units) * per_stage
    elements = sum(a * b for a, b in units) * per_stage
    ranks, split, replicas = _holders(layout)
    rate = hw.peak_flops * hw.efficiency
    compute = max(flops / ranks, max(newton_schulz_flops(u) for u in units)) / rate
    moved = elements * (split * (1 + replicas) - 2) / (split * ranks) * NS_BYTES if ranks > 1 else 0.0
    bandwidth = hw.intra_node_bw if ranks <= hw.devices_per_node else hw.inter_node_bw
    buckets = _buckets(units, bucket_mb)
    exchange = 2 * buckets * hw.latency_s + moved / bandwidth if ranks > 1 else 0.0
    exposed = max(compute, exchange) + min(compute, exchange) / buckets  # pipelined by bucket
    return {"newton-schulz": compute, "exchange": exposed - compute}


def _holders(layout: Layout) -> tuple[int, int, float]:
    """(R ranks of a stage, S ways each element is cut, r = R / S replicas of each piece)."""
    ranks = layout.dims.grid_size // layout.pp
    split = layout.tp * (layout.shards if layout.zero else 1)
    return ranks, split, ranks / split


def _buckets(units: tuple[tuple[int, int], ...], bucket_mb: float, ns_bytes: int = NS_BYTES) -> int:
    """How many buckets the exchange cuts the model's units into (about: each owner's share at least a unit)."""
    per_bucket = max(1, int(bucket_mb * 2**20) // ns_bytes)
    return max(1, math.ceil(sum(a * b for a, b in units) / per_bucket))


def exchange_elements(model: ModelConfig, layout: Layout, *, matrix_elements: int, bucket_mb: float,
                      ns_bytes: int = NS_BYTES) -> float:
    """An estimate of the elements a Muon step's matrix part holds at its peak on a rank holding `matrix_elements`
    of the matrices (its ZeRO shard of them, or its tp slices): the update inputs and the exchange's copy of them,
    plus at its worst bucket the units it owns there o (its share of the bucket, at least the largest unit, owned
    whole), their gather g and scatter s (send and receive buffers): o + max(g, s), and beside it the next bucket's
    gather and the previous one's scatter where there are more buckets. paratrain.optim.MatrixExchange.peak_bytes
    counts the same from its plan (tests/distributed/test_muon.py: 1.01-1.07x that on four layouts of the
    tiny GPT; bound 1.25); not to the byte: who owns what is balanced by FLOPs, not priced per rank."""
    units = matrix_units(model)
    if not units:
        return 0.0
    ranks, split, replicas = _holders(layout)
    sizes = [a * b for a, b in units]
    per_bucket = max(1, int(bucket_mb * 2**20) // ns_bytes)
    n = _buckets(units, bucket_mb, ns_bytes)
    bucket = min(sum(sizes), per_bucket) / layout.pp  # a bucket's elements this stage holds
    own = max(bucket / ranks, max(sizes))
    if ranks == 1:
        return 2 * matrix_elements + own
    gather = 2 * own * (split - 1) / split  # its units' pieces received, as many of others' sent
    scatter = 2 * own * (replicas - 1 / split)
    beside = gather + scatter if n >= 3 else max(gather, scatter) if n == 2 else 0.0
    return 2 * matrix_elements + own + max(gather, scatter) + beside
