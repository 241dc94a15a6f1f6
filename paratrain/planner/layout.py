"""A candidate layout, and the parameters one rank of it holds, derived from the model's shapes alone.

The planner predicts what paratrain will do, so it reads paratrain's own rules where they are pure
functions (the pipeline's balanced split, the gradient buckets' plan) rather than re-deriving them;
what it cannot call without processes (which module tensor parallelism splits, which parameters a
ZeRO-3 unit owns) it states here for the reference GPT, next to the rule it mirrors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import CP_MODES, ParallelConfig
from paratrain.config.rules import check_shard_group, check_usp
from paratrain.pipeline.schedules import Schedule
from paratrain.pipeline.split import balanced_split
from paratrain.topology.dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    """One way to lay a run out (the planner's search space): the degree of each axis, and the memory
    savers. Build one from flat fields (as to_dict writes them) with Layout.of."""

    dims: ParallelDims = ParallelDims()
    """Without ZeRO its dp_shard is 1; with ZeRO, the ranks one copy of the state is split over."""
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    """none, selective (the attention core) or full (each block)."""
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    offload: bool = False
    """ZeRO's optimizer state and fp32 masters in CPU memory."""
    cp_mode: str = "ring"
    """Context parallelism's attention (cp > 1): 'ring', 'ulysses' or 'usp' (Ulysses over dims.cp_ulysses ranks,
    a ring across)."""
    ps_mode: str = "off"
    """The parameter server: 'off', 'sync' or 'async'; its dedicated servers are dims.servers (0: colocated
    on the dp trainers). Which axes it composes with is ParallelConfig's rule (search.check_fields)."""
    staleness: int = 0
    """ps_mode 'async': the clocks a trainer may run ahead."""
    expert_tp: bool = False
    """Every expert cut over tp along its width (paratrain.expert_parallel.tensor); false: replicated over tp."""

    def __post_init__(self) -> None:
        if not self.zero and self.dims.dp_shard > 1:
            raise ConfigError(f"dp_shard ({self.dims.dp_shard}) splits ZeRO's state, and zero is 0: set zero to "
                              "1, 2 or 3, or dp_shard to 1")
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"cp_mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")
        if self.cp_mode == "usp":  # (a partial Layout the planner derives for one term keeps dims, not cp_mode)
            check_usp(self.cp, self.cp_mode, self.cp_ulysses)
        if self.ps_mode not in ("off", "sync", "async"):
            raise ConfigError(f"ps_mode must be 'off', 'sync' or 'async', got {self.ps_mode!r}")

    @classmethod
    def of_config(cls, parallel: ParallelConfig, dims: ParallelDims, *, micro_batch: int, recompute: str) -> Layout:
        """The layout a run of this resolved ParallelConfig has (dims: its ParallelDims, which the config's DiLoCo and
        replica groups shape), with the run's micro-batch and recomputation."""
        return cls(dims=dims, zero=parallel.zero, micro_batch=micro_batch, recompute=recompute,
                   sequence_parallel=parallel.sequence_parallel, schedule=parallel.schedule,
                   offload="optimizer" in parallel.offloaded, cp_mode=parallel.cp_mode, ps_mode=parallel.ps_mode,
                   staleness=parallel.staleness, expert_tp=parallel.expert_tp)

    @classmethod
    def of(cls, **fields: Any) -> Layout:
        """From flat fields, to_dict's: dp, tp, pp, virtual_stages, ep, cp, shard_group (ZeRO over groups of this
        many dp ranks, MiCS / HSDP; None: all of dp) and the memory savers; the rest take their defaults."""
        unknown = sorted(set(fields) - set(LAYOUT_FIELDS))
        if unknown:
            raise ConfigError(f"unknown layout fields {unknown}: a layout has {list(LAYOUT_FIELDS)}")
        axes = {name: fields.pop(name) for name in ("dp", "tp", "pp", "virtual_stages", "ep", "cp", "tp_mode", "tp_depth",
                                                      "cp_ulysses") if name in fields}
        if "ps_servers" in fields:
            axes["servers"] = fields.pop("ps_servers")
        shard_group, zero, dp = fields.pop("shard_group", None), fields.get("zero", 0), axes.get("dp", 1)
        check_shard_group(shard_group, zero, dp)
        shard = (shard_group or dp) if zero else 1
        return cls(dims=ParallelDims.of(**axes, dp_shard=shard), **fields)

    @property
    def dp(self) -> int:
        return self.dims.dp

    @functools.cached_property
    def saved_fields(self) -> tuple[Any, ...]:
        """What a micro-batch's saved activations read of the layout (the planner caches them on it; of_saved builds
        a layout of them): the dims, micro-batch, recompute, sequence parallelism, cp's mode and expert tp."""
        return (self.dims, self.micro_batch, self.recompute, self.sequence_parallel, self.cp_mode, self.expert_tp)

    @classmethod
    def of_saved(cls, saved: tuple[Any, ...]) -> Layout:
        """A layout of saved_fields (dp replicated: saved activations do not read ZeRO's split)."""
        dims, micro_batch, recompute, sequence_parallel, cp_mode, expert_tp = saved
        return cls(dims=replace(dims, dp_replicate=dims.dp, dp_shard=1), micro_batch=micro_batch, recompute=recompute,
                   sequence_parallel=sequence_parallel, cp_mode=cp_mode, expert_tp=expert_tp)

    def local_tokens(self, seq: int) -> int:
        """The tokens of a sequence of `seq` this rank holds (ParallelDims.sequence_parts split it)."""
        return seq // self.dims.sequence_parts

    @functools.cached_property
    def pipeline(self) -> Schedule | None:
        """The pipeline schedule (paratrain.pipeline.schedules.Schedule: placement, programs, bubble); None at pp 1."""
        return Schedule(self.schedule, self.pp, self.virtual_stages) if self.pp > 1 else None

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The pipeline chunks rank `stage` holds (the schedule's placement)."""
        return stage_chunks(self.dims, stage, self.pipeline)

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def tp_mode(self) -> str:
        """How tp splits each layer: 1d, 2d, 2.5d or 3d (paratrain.tensor_parallel)."""
        return self.dims.tp_mode

    @property
    def tp_depth(self) -> int:
        return self.dims.tp_depth

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def virtual_stages(self) -> int:
        return self.dims.virtual_stages

    @property
    def ep(self) -> int:
        """Expert parallelism: each MoE layer's experts divided among ep consecutive dp ranks."""
        return self.dims.ep

    @property
    def cp(self) -> int:
        """Context parallelism: each sequence split over cp ranks."""
        return self.dims.cp

    @property
    def cp_ulysses(self) -> int:
        """USP: the Ulysses degree inside cp (1 for ring and Ulysses alone)."""
        return self.dims.cp_ulysses

    @property
    def ps_servers(self) -> int:
        """Dedicated parameter servers, ranks after the dp trainers (0: none, or colocated)."""
        return self.dims.servers

    @property
    def shard_group(self) -> int | None:
        """ZeRO over groups of this many dp ranks (MiCS / HSDP); None: all of dp (or no ZeRO)."""
        return self.dims.dp_shard if self.zero and self.dims.dp_shard != self.dims.dp else None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def shards(self) -> int:
        """Ranks one copy of ZeRO's state is split over (under cp, a shard group's dp ranks times their cp
        ranks: paratrain.topology.mesh)."""
        return self.dims.dp_shard * self.dims.cp

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO splits the experts' state over: the dp / ep ranks holding the same experts (edp), times
        cp."""
        return self.dp // self.ep * self.dims.cp if self.zero else 1

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}  # flat, no deep copy: the search calls it often


LAYOUT_FIELDS = ("dp", "tp", "pp", "virtual_stages", "zero", "shard_group", "micro_batch", "recompute",
                 "sequence_parallel", "schedule", "offload", "ep", "cp", "cp_mode", "cp_ulysses", "ps_mode", "ps_servers",
                 "staleness", "expert_tp", "tp_mode", "tp_depth")
"""A layout's flat fields (to_dict, Layout.of), in the order the planner's records list them."""


def layer_costs(model: ModelConfig) -> list[float]:
    """The pipeline's balancing costs per GPT layer (paratrain.pipeline.stages.gpt_layers): the
    embedding, the blocks, the head."""
    d, f, v, s = model.d_model, model.ff_dim, model.padded_vocab, model.seq_len
    block = 2 * (4 * d * d + 2 * d * f) + 4 * s * d
    mtp = model.mtp_depth * (block + 2 * (2 * d * d + d * v))  # the depths run with the head
    return [2.0 * d] + [float(block)] * model.n_layer + [2.0 * d * v + mtp]


def chunk_layers(model: ModelConfig, dims: ParallelDims, pp_split: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """[start, end) GPT layers of each of the pp x v chunks, as the engine cuts them."""
    return list(layer_ranges(model, dims.pp * dims.virtual_stages, tuple(pp_split)))


@functools.lru_cache(maxsize=4096)
def layer_ranges(model: ModelConfig, parts: int, pp_split: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """chunk_layers for `parts` chunks (cached: the search asks for every candidate)."""
    starts = [0, *pp_split] if pp_split else balanced_split(layer_costs(model), parts)
    return tuple(zip(starts, [*starts[1:], model.n_layer + 2]))


def stage_chunks(dims: ParallelDims, stage: int, pipeline: Schedule | None) -> tuple[int, ...]:
    """The chunks pipeline rank `stage` holds: the schedule's placement (None: no pipeline, the one chunk)."""
    if pipeline is None:
        if dims.pp * dims.virtual_stages != 1:
            raise ValueError(f"pp {dims.pp} x {dims.virtual_stages} chunks: give the pipeline schedule (Layout.pipeline)")
        return (0,)
    if (pipeline.stages, pipeline.chunks) != (dims.pp, dims.virtual_stages):
        raise ValueError(f"a schedule of {pipeline.stages} x {pipeline.chunks} chunks for pp {dims.pp} x "
                         f"{dims.virtual_stages}")
    return tuple(pipeline.chunks_of(stage))
