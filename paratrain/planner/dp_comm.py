"""Bytes one rank moves over data parallelism in one step, exactly as paratrain issues them, counted as
paratrain.planner.comm counts (an all-reduce of n bytes moves 2n; a reduce-scatter n in, an all-gather n out).

Data parallelism (`data_parallel_volume`), gradients and parameters:
    zero 0    one all-reduce of every gradient bucket per step (accumulation syncs the last
              micro-batch only), float32 gradients
    zero 1    each flat group (padded) reduced once per step (all-reduce on gloo, reduce-scatter on
              NCCL), then its shards all-gathered once
    zero 2    reduced after every micro-batch's backward (once per step under a pipeline, which defers
              it), all-gathered once
    zero 3    reduced after every micro-batch; a block's group gathered for its forward and again for
              its backward (once when parameters stay from forward to backward), the root's (embedding,
              final norm, head) once per micro-batch; under fp8 (tensorwise) the blocks' linear weights
              in float8, one byte an element, in groups of their own
    hierarchical sharding (MiCS / HSDP: ZeRO within shard groups of S < dp ranks, the dp / S groups
              replicas of each other): the gathers and reduce-scatters stay within the shard group
              (axis dp_shard), each reduced shard is then all-reduced across the replicas
              (dp_replicate); an all-reduce reduction is one all-reduce over the whole of dp
    experts (under ep) the same over the ranks holding the same experts (ParallelDims.expert_replicas), in flat groups of their own
"""

from __future__ import annotations

from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout
from paratrain.planner.memory import flat_groups
from paratrain.planner.params import RankParam, rank_params
from paratrain.planner.settings import BYTES, StepSettings

FLOAT8_BYTES = 1


def data_parallel_volume(model: ModelConfig, layout: Layout, *, stage: int, micro_batches: int,
                         settings: StepSettings = StepSettings()) -> dict[str, dict[str, int]]:
    """{axis: {op: bytes}} of the gradients and parameters pipeline rank `stage` moves over dp in one
    step of `micro_batches` micro-batches (empty when dp is 1). Axis "dp"; with hierarchical sharding
    (ZeRO over shard groups of S < dp ranks): "dp_shard" for the reduce-scatters and the gathers
    within a shard group, "dp_replicate" for the all-reduce of each shard across the dp / S copies
    (an all-reduce reduction stays one all-reduce over dp)."""
    if layout.dims.replicas == 1:
        return {}
    data = layout.dims.data_axis
    volume: dict[str, dict[str, int]] = {}
    params = rank_params(model, layout.dims, stage, settings.pp_split, expert_tp=layout.expert_tp,
                         pipeline=layout.pipeline)
    dense = [p for p in params if not p.expert]
    _reduce_and_gather(volume, dense, layout, micro_batches, settings, axis=data, shards=layout.shards)
    experts = [p for p in params if p.expert]
    if experts and layout.dims.expert_replicas > 1:  # over the ranks holding the same experts (ep > 1 only)
        _reduce_and_gather(volume, experts, layout, micro_batches, settings, axis=layout.dims.expert_data_axis,
                           shards=layout.expert_shards)
    return volume


def _reduce_and_gather(volume: dict[str, dict[str, int]], params: list[RankParam], layout: Layout, micro_batches: int,
                       settings: StepSettings, *, axis: str, shards: int) -> None:
    """Add the gradient reduction and (ZeRO) parameter gathers of `params` over `axis` (`shards` ranks under ZeRO)."""
    def add(on: str, op: str, n: int) -> None:
        volume.setdefault(on, {})[op] = volume.get(on, {}).get(op, 0) + n

    if not params:
        return
    if layout.zero == 0:
        add(axis, "all_reduce", 2 * 4 * sum(p.numel for p in params))
        return
    if layout.shard_group == 1:
        raise NotImplementedError("the volume of ZeRO with shard groups of one rank (replicated state) is not modelled")
    hierarchical = axis in ("dp", "dp_cp") and layout.shard_group not in (None, layout.dp)
    shard_axis = "dp_shard" if hierarchical else axis
    elsize, gsize = BYTES[settings.precision], settings.reduce_bytes(layout)
    groups = flat_groups(params, zero=layout.zero, shards=shards, bucket_bytes=int(settings.bucket_mb * 2**20),
                         expert_shards=shards, float8=settings.float8_gathers(layout))
    reductions = 1 if layout.zero == 1 or layout.pp > 1 else micro_batches
    for g in groups:
        if settings.grad_reduce == "reduce_scatter":
            add(shard_axis, "reduce_scatter", reductions * gsize * g.padded)
            if hierarchical:
                add("dp_replicate", "all_reduce", reductions * 2 * gsize * g.shard_numel)
        else:
            add(axis, "all_reduce", reductions * 2 * gsize * g.padded)
    if layout.zero < 3:
        add(shard_axis, "all_gather", elsize * sum(g.padded for g in groups))
    else:  # flat_groups lists the blocks' groups first, the root's last
        root = _root_groups(params)
        blocks, roots = groups[:len(groups) - root], groups[len(groups) - root:]
        per_block = 2 if settings.reshard_after_forward else 1
        gathered = sum(g.padded * (FLOAT8_BYTES if g.float8 else elsize) for g in blocks)  # float8: one byte
        add(shard_axis, "all_gather", micro_batches * (per_block * gathered + elsize * sum(g.padded for g in roots)))




def _root_groups(params: list[RankParam]) -> int:
    """How many of ZeRO-3's flat groups belong to the root unit (one per optimizer group and role)."""
    return len({(len(p.shape) >= 2, p.tp_split, p.tied, p.norm_skip, p.grid_vector) for p in params if not p.unit})


def outer_elements(model: ModelConfig, group: Layout, *, stage: int, settings: StepSettings = StepSettings()) -> int:
    """DiLoCo (dp_mode 'diloco'): the elements one rank's outer step all-reduces over the replica groups, every
    inner_steps steps: what its inner optimizer steps (paratrain.data_parallel.diloco). `group` is one replica
    group's layout (its dp the group's dp ranks): its parameters on pipeline rank `stage`, or under ZeRO its shard
    of each flat group, padding included. The bytes moved are 2 x this x the optimizer's element size (float32
    masters or parameters), as for any all-reduce (paratrain.comm.volume)."""
    params = rank_params(model, group.dims, stage, settings.pp_split, expert_tp=group.expert_tp,
                         pipeline=group.pipeline)
    if group.zero == 0:
        return sum(p.numel for p in params)
    groups = flat_groups(params, zero=group.zero, shards=group.shards, bucket_bytes=int(settings.bucket_mb * 2**20),
                         expert_shards=group.expert_shards, float8=settings.float8_gathers(group))
    return sum(g.shard_numel for g in groups)
