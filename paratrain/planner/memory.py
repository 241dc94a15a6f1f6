"""Bytes one rank holds: model states in a step and between steps, exactly as paratrain holds them.

`model_state_bytes` mirrors `engine.memory_report()` (tests/distributed/test_planner.py checks it
to the byte on 19 layouts of 2 and 4 ranks): parameters, gradients and optimizer state (AdamW: two moments
and a 4-byte step per tensor it updates, plus ZeRO's fp32 masters when parameters are stored in 16
bits or offloaded), with paratrain's own flat groups and their padding to a multiple of the shard
group. The textbook form, (2 + 2 + K) psi over the ZeRO stages, is paratrain.planner.textbook's.

    zero 0     every parameter, its gradient buffer (no padding), AdamW state per parameter
    zero 1/2   flat groups (paratrain.comm.plan_buckets: ~bucket_mb each, one optimizer group and one
               gradient role each) padded to a multiple of S; parameters whole; zero 1 keeps whole
               gradient buffers (and, reducing by reduce-scatter, a shard beside each), zero 2 shards
               (under pp it accumulates the step's micro-batches in whole buffers first: both in a step)
    zero 3     flat groups per unit (a block, or the root: embedding, final norm, head); shards only
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from paratrain.optim import is_matrix
from paratrain.pipeline.schedules import Schedule
from paratrain.comm.buckets import plan_buckets
from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout
from paratrain.planner.params import RankParam, meta_tensors, rank_params
from paratrain.planner.settings import BYTES, StepSettings
from paratrain.topology.dims import ParallelDims


MASTER_BYTES = 4
"""fp32: what the model is built in, so what ZeRO's masters and AdamW's moments are kept in."""
STEP_BYTES = 4
"""AdamW's step count: a float32 scalar tensor per parameter it updates."""
OPTIMIZER_STATES = {"adamw": 2, "muon": 1}
"""Float32 state tensors per element: AdamW's two moments; Muon's momentum (on its matrices; the rest is AdamW's)."""


@dataclass(frozen=True)
class FlatPlan:
    padded: int
    shards: int
    kind: str = "adamw"
    """The optimizer updating it: 'adamw', or 'muon' (paratrain.optim.Muon's matrix group)."""
    float8: bool = False
    """ZeRO-3 gathers it in float8 (the weights of float8 linears under the tensorwise recipe)."""

    @property
    def shard_numel(self) -> int:
        return self.padded // self.shards


def optimizer_group(param: RankParam, optimizer: str = "adamw") -> int:
    """paratrain.train.optim.adamw_factory: matrices decay (group 0), vectors do not (group 1); paratrain.optim.Muon:
    its matrices (0), the matrices it leaves to AdamW (1: embeddings, head), vectors (2)."""
    if optimizer == "muon":
        return 0 if is_matrix(param.name, param.shape) else 1 if len(param.shape) >= 2 else 2
    if optimizer == "sgd":  # paratrain.train.optim's: one group
        return 0
    return 0 if len(param.shape) >= 2 else 1


def optimizer_bytes(optimizer: str, *, muon: int, adamw: int, adamw_tensors: int, state_dtype: str = "fp32") -> int:
    """State bytes over `muon` elements Muon updates and `adamw` elements (in `adamw_tensors` tensors) AdamW does
    (sgd: its momentum on all of them), each state in `state_dtype` (fp32 or bf16; the step counts float32)."""
    size = 2 if state_dtype == "bf16" else 4
    if optimizer == "sgd":
        return 4 * (muon + adamw)
    return size * (OPTIMIZER_STATES["muon"] * muon + OPTIMIZER_STATES["adamw"] * adamw) + STEP_BYTES * adamw_tensors


def _role(param: RankParam) -> tuple[bool, bool, bool, bool, bool]:
    """ZeroSync keys flat groups by paratrain.comm.placement.Placement: different placements never share one.
    The last is whether it is an expert group (split over expert_shards)."""
    return param.tp_split, param.tied, param.norm_skip, param.grid_vector, param.expert


def flat_groups(params: list[RankParam], *, zero: int, shards: int, bucket_bytes: int,
                expert_shards: int = 1, optimizer: str = "adamw", float8: bool = False) -> list[FlatPlan]:
    """ZeroSync's flat groups for these parameters, in its order; experts' split over expert_shards. float8: ZeRO-3
    gathers the blocks' linear weights in float8, in groups of their own (paratrain.sharding.float8_gather)."""
    plans = []
    for n, expert, matrix, cast in _group_sizes(tuple(params), zero == 3, bucket_bytes, optimizer, float8):
        parts = expert_shards if expert else shards
        plans.append(FlatPlan(_padded(n, parts), parts, "muon" if matrix else "adamw", cast))
    return plans


def _padded(elements: int, shards: int) -> int:
    """A flat group's elements padded to a multiple of its shard count."""
    return math.ceil(elements / shards) * shards


@functools.lru_cache(maxsize=4096)
def _group_sizes(params: tuple[RankParam, ...], zero3: bool, bucket_bytes: int, optimizer: str,
                 float8: bool) -> tuple[tuple[int, bool, bool, bool], ...]:
    """(elements, an expert group, Muon's, gathered in float8) of each flat group before padding: how the groups
    are cut does not depend on the shard count (the search asks for many)."""
    return tuple((sum(params[i].numel for i in members), expert, matrix, cast)
                 for members, expert, matrix, cast in flat_members(params, zero3, bucket_bytes, optimizer, float8))


@functools.lru_cache(maxsize=4096)
def flat_members(params: tuple[RankParam, ...], zero3: bool, bucket_bytes: int, optimizer: str,
                 float8: bool) -> tuple[tuple[tuple[int, ...], bool, bool, bool], ...]:
    """ZeroSync's flat groups (paratrain.sharding.groups) before padding: (the indices in `params` of its
    parameters, in the order the group lays them out; an expert group; Muon's; gathered in float8) of each."""
    present = sorted({optimizer_group(p, optimizer) for p in params})
    group_of = {id(p): present.index(optimizer_group(p, optimizer)) for p in params}  # empty groups are dropped
    muon = {id(p) for p in params if optimizer == "muon" and optimizer_group(p, optimizer) == 0}
    index = {id(p): i for i, p in enumerate(params)}
    if not zero3:
        tensors = meta_tensors(list(params), torch.float32)  # planned on the parameters as built: fp32
        by_id = {id(t): p for t, p in zip(tensors, params)}
        planned = plan_buckets(tensors, cap_bytes=bucket_bytes,
                               key=lambda t: (group_of[id(by_id[id(t)])], _role(by_id[id(t)])))
        return tuple((tuple(index[id(by_id[id(t)])] for t in group), by_id[id(group[0])].expert,
                      id(by_id[id(group[0])]) in muon, False) for group in planned)
    units: dict[str, list[RankParam]] = {}
    for p in params:
        units.setdefault(p.unit, []).append(p)
    blocks = [u for u in units if u]
    groups = []
    for unit in [*reversed(blocks), *([""] if "" in units else [])]:
        by_key: dict[tuple[int, tuple[bool, ...], bool, bool], list[int]] = {}
        for p in units[unit]:
            key = (group_of[id(p)], _role(p), id(p) in muon, float8 and p.block_linear)
            by_key.setdefault(key, []).append(index[id(p)])
        # role[-1]: an expert group
        groups += [(tuple(members), role[-1], matrix, cast) for (_, role, matrix, cast), members in by_key.items()]
    return tuple(groups)


@functools.lru_cache(maxsize=8192)
def _sharded_totals(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...],
                    bucket_bytes: int, optimizer: str = "adamw", float8: bool = False) -> tuple[int, int, int, int]:
    """(padded elements, shard elements, of which Muon's, AdamW's flat groups) of a stage's ZeRO flat groups
    (`layout`: its dims and ZeRO stage, what they depend on): flat_groups' sums."""
    slices = Layout(dims=layout.dims.parameter_slices(), expert_tp=layout.expert_tp, schedule=layout.schedule)
    sizes = _stage_group_sizes(model, slices, stage, pp_split, layout.zero == 3, bucket_bytes, optimizer, float8)
    padded = shard = muon = adamw = 0
    for n, expert, matrix, _ in sizes:
        parts = layout.expert_shards if expert else layout.shards
        group = _padded(n, parts)
        padded, shard = padded + group, shard + group // parts
        if matrix:
            muon += group // parts
        else:
            adamw += 1
    return padded, shard, muon, adamw


@functools.lru_cache(maxsize=4096)
def _stage_group_sizes(model: ModelConfig, slices: Layout, stage: int, pp_split: tuple[int, ...], zero3: bool,
                       bucket_bytes: int, optimizer: str, float8: bool) -> tuple[tuple[int, bool, bool, bool], ...]:
    """_group_sizes of a stage's parameters, cached on what makes them (slices: a layout of the axes that cut
    parameters, ParallelDims.parameter_slices, expert tp and the schedule's placement) rather than on the parameters
    themselves, a long tuple to hash."""
    params = rank_params(model, slices.dims, stage, pp_split, expert_tp=slices.expert_tp, pipeline=slices.pipeline)
    return _group_sizes(tuple(params), zero3, bucket_bytes, optimizer, float8)


@functools.lru_cache(maxsize=8192)
def _plain_totals(model: ModelConfig, dims: ParallelDims, stage: int, pp_split: tuple[int, ...],
                  expert_tp: bool = False, pipeline: Schedule | None = None,
                  optimizer: str = "adamw") -> tuple[int, int, int]:
    """(elements, of which Muon's, AdamW's tensors) a stage holds."""
    params = rank_params(model, dims, stage, pp_split, expert_tp=expert_tp, pipeline=pipeline)
    muon = [p for p in params if optimizer == "muon" and optimizer_group(p, optimizer) == 0]
    return sum(p.numel for p in params), sum(p.numel for p in muon), len(params) - len(muon)


def with_totals(states: dict[str, int], *, kept_grads: int = 0) -> dict[str, int]:
    """{"params", "grads", "optimizer"} and, as engine.memory_report() adds them, "in_step" (their sum: the
    gradient buffers exist while a step runs) and "between_steps" (without the gradients, but `kept_grads`)."""
    in_step = states["params"] + states["grads"] + states["optimizer"]
    return {**states, "in_step": in_step, "between_steps": in_step - states["grads"] + kept_grads}


def model_state_bytes(model: ModelConfig, layout: Layout, *, stage: int = 0,
                      settings: StepSettings = StepSettings()) -> dict[str, int]:
    """What `engine.memory_report()` says on pipeline rank `stage` (every dp and tp rank of a stage
    holds the same amounts): {"params", "grads", "optimizer", "in_step", "between_steps"} in bytes, the GPT
    ("grads": the buffers a step allocates, released after its update unless settings.keep_grads), AdamW, Muon
    (paratrain.train.optim's: a momentum on the matrices, AdamW's state on the rest) or SGD.

    settings.precision: under ZeRO, bf16 / fp16 store parameters in 16 bits with fp32 masters, and gradients in
    float32 (grad_dtype 'fp32', the default) or 16 bits (grad_dtype 'bf16' / 'fp16'); under zero 0 they are autocast
    over fp32 storage. settings.grad_reduce: ZeRO's reduction primitive ("all_reduce": gloo's choice;
    "reduce_scatter": NCCL's)."""
    optimizer, state_dtype, pp_split = settings.optimizer, settings.state_dtype, settings.pp_split
    if layout.zero == 0:
        numel, muon, tensors = _plain_totals(model, layout.dims, stage, tuple(pp_split), layout.expert_tp,
                                             layout.pipeline, optimizer)
        return with_totals({"params": 4 * numel, "grads": 4 * numel,
                            "optimizer": optimizer_bytes(optimizer, muon=muon, adamw=numel - muon,
                                                         adamw_tensors=tensors, state_dtype=state_dtype)},
                           kept_grads=4 * numel if settings.keep_grads else 0)
    elsize = BYTES[settings.precision]
    padded, shard, muon, groups = _sharded_totals(
        model, Layout(dims=layout.dims, zero=layout.zero, expert_tp=layout.expert_tp, schedule=layout.schedule),
        stage, tuple(pp_split), int(settings.bucket_mb * 2**20), optimizer, settings.float8_gathers(layout))
    param_bytes = elsize * (shard if layout.zero == 3 else padded)
    gsize = settings.grad_bytes(layout)  # EngineOptions.grad_dtype: the buffers' dtype
    if layout.zero == 1:
        separate_shards = settings.grad_reduce == "reduce_scatter"
        grad_bytes = kept = gsize * (padded + (shard if separate_shards else 0))
    else:  # a pipeline's deferred ZeRO-2 accumulates the step's micro-batches in full buffers, then shards
        kept = gsize * shard
        grad_bytes = kept + (gsize * padded if layout.zero == 2 and layout.pp > 1 else 0)
    own_master = layout.offload or elsize != MASTER_BYTES
    masters = MASTER_BYTES * shard if own_master else 0
    state = optimizer_bytes(optimizer, muon=muon, adamw=shard - muon, adamw_tensors=groups,
                            state_dtype=state_dtype) + masters
    return with_totals({"params": param_bytes, "grads": grad_bytes, "optimizer": state},
                       kept_grads=kept if settings.keep_grads else 0)
