"""Bytes one rank moves per step over the data-parallel axis for gradients and parameters, exactly as
paratrain issues them, counted the way the ZeRO paper does (paratrain.comm.volume: an all-reduce of n
bytes moves 2n, a reduce-scatter whose input is n bytes or an all-gather whose output is n moves n).

    zero 0    one all-reduce of every gradient bucket per step (accumulation syncs the last
              micro-batch only), float32 gradients
    zero 1    each flat group (padded) reduced once per step (all-reduce on gloo, reduce-scatter on
              NCCL), then its shards all-gathered once
    zero 2    reduced after every micro-batch's backward (once per step under a pipeline, which defers
              it), all-gathered once
    zero 3    reduced after every micro-batch; a block's group gathered for its forward and again for
              its backward (once when parameters stay from forward to backward), the root's (embedding,
              final norm, head) once per micro-batch

`paratrain plan --dry-run` runs a step on the meta device and checks its recorded collectives
against this (tests/unit/test_dryrun.py, up to 1,024 ranks). Tensor- and pipeline-parallel traffic,
and the few scalars a step reduces (the loss, the gradient norm), are not modelled here.
"""

from __future__ import annotations

from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout, rank_params
from paratrain.planner.memory import BYTES, flat_groups


def data_parallel_volume(model: ModelConfig, layout: Layout, *, stage: int, micro_batches: int,
                         precision: str = "fp32", bucket_mb: float = 25.0, grad_reduce: str = "all_reduce",
                         reshard_after_forward: bool = True, pp_split: tuple[int, ...] = ()) -> dict[str, int]:
    """{"all_reduce", "reduce_scatter", "all_gather"} bytes pipeline rank `stage` moves over dp in
    one step of `micro_batches` micro-batches (ZeRO-paper counting; zeros when dp is 1)."""
    volume = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    if layout.dp == 1:
        return volume
    if layout.shard_group not in (None, layout.dp) and layout.zero:
        raise NotImplementedError("the volume of hierarchical sharding (shard_group < dp) is not modelled")
    params = rank_params(model, layout, stage, pp_split)
    if layout.zero == 0:
        volume["all_reduce"] = 2 * 4 * sum(p.numel for p in params)
        return volume
    elsize = BYTES[precision]
    groups = flat_groups(params, zero=layout.zero, shards=layout.shards, bucket_bytes=int(bucket_mb * 2**20))
    reductions = 1 if layout.zero == 1 or layout.pp > 1 else micro_batches
    for g in groups:
        if grad_reduce == "reduce_scatter":
            volume["reduce_scatter"] += reductions * elsize * g.padded
        else:
            volume["all_reduce"] += reductions * 2 * elsize * g.padded
    if layout.zero < 3:
        volume["all_gather"] = elsize * sum(g.padded for g in groups)
    else:  # flat_groups lists the blocks' groups first, the root's last
        root = _root_groups(params)
        blocks, roots = groups[:len(groups) - root], groups[len(groups) - root:]
        per_block = 2 if reshard_after_forward else 1
        volume["all_gather"] = micro_batches * elsize * (per_block * sum(g.padded for g in blocks)
                                                         + sum(g.padded for g in roots))
    return volume


def _root_groups(params: list) -> int:
    """How many of ZeRO-3's flat groups belong to the root unit (one per optimizer group and role)."""
    return len({(len(p.shape) >= 2, p.tp_split, p.tied, p.norm_skip) for p in params if not p.unit})
