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
"""

from __future__ import annotations

import functools

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


def muon_seconds(model: ModelConfig, layout: Layout, hw: Hardware) -> dict[str, float]:
    """{"newton-schulz", "exchange"}: seconds of the busiest rank's Muon step beyond an element-wise optimizer's."""
    units = matrix_units(model)
    if not units:
        return {"newton-schulz": 0.0, "exchange": 0.0}
    per_stage = 1.0 / layout.pp
    flops = sum(newton_schulz_flops(u) for u in units) * per_stage
    elements = sum(a * b for a, b in units) * per_stage
    ranks = layout.dims.grid_size // layout.pp  # the ranks of a stage
    split = layout.tp * (layout.shards if layout.zero else 1)
    replicas = ranks / split
    rate = hw.peak_flops * hw.efficiency
    compute = max(flops / ranks, max(newton_schulz_flops(u) for u in units)) / rate
    moved = elements * (split * (1 + replicas) - 2) / (split * ranks) * NS_BYTES if ranks > 1 else 0.0
    bandwidth = hw.intra_node_bw if ranks <= hw.devices_per_node else hw.inter_node_bw
    exchange = 2 * hw.latency_s + moved / bandwidth if ranks > 1 else 0.0
    return {"newton-schulz": compute, "exchange": exchange}
