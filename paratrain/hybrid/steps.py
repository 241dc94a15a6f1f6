"""The steps parallelize runs, in its order, each on the model, the Context and its own options.

A step at degree 1 does nothing and returns None; a step that changes which tensors a rank holds
returns its paratrain.state_layout.StateLayout (apply_pipeline, apply_tensor_layout, and
apply_expert_layouts: expert tensor and expert parallelism)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from paratrain.comm import broadcast
from paratrain.comm.placement import Placements
from paratrain.config.errors import ConfigError
from paratrain.config.model_rules import check_float8_layout
from paratrain.config.parallel import ParallelConfig
from paratrain.config.pp_layout import layout_split
from paratrain.context_parallel import SequenceShard
from paratrain.data_parallel import apply_synced_batch_norm, batch_norms, buffer_rules
from paratrain.expert_parallel import ExpertLayout, apply_expert_parallel
from paratrain.expert_parallel.tensor import ExpertTensorLayout, apply_expert_tensor_parallel
from paratrain.hybrid.compile import compile_blocks
from paratrain.hybrid.materialize import Inits, Source, materialize
from paratrain.hybrid.pieces import Pieces
from paratrain.memory import (Float8Settings, Precision, apply_activation_offload, apply_float8, apply_recompute,
                              recompute_pattern)
from paratrain.memory.float8_linears import float8_linears
from paratrain.models.init import ParamInit
from paratrain.nn.recipe import Recipe
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.pipeline.schedules import Schedule
from paratrain.pipeline.stages import PipelineLayout, StageModel, chunk_ranges, model_layers
from paratrain.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelLayout,
                                      apply_tensor_parallel, check_ties)
from paratrain.tensor_parallel.plan import resolve_plan
from paratrain.tensor_parallel.cube import Cube
from paratrain.tensor_parallel.grid import Grid
from paratrain.tensor_parallel.grid_layers import GridLinear
from paratrain.tensor_parallel.grid_plan import GridLayout, apply_grid_tensor_parallel
from paratrain.tensor_parallel.sequence import route_sequence_chunks
from paratrain.topology import AxisGroup, Context


@dataclass(frozen=True)
class MemorySavers:
    """What trades compute for memory, applied by module name to the recipe's blocks."""

    recompute: str = "none"
    """'full' each block, 'selective' its attention core, 'none', or a regex of module names."""
    compile: bool | str = False
    """torch.compile each block: True inductor, or a backend's name."""
    offload_activations: bool = False
    """Each block's saved activations to CPU memory in forward, back in backward."""


def check_whole_model(model: nn.Module, recipe: Recipe, *, tp: int, pp: int, buffers: Mapping[str, str]) -> None:
    """What must be refused on the whole model, before a pipeline cut hides part of it from this rank; pure (no
    process group), so paratrain.Trainer runs it in the launching process before any worker starts: tp without a
    plan, a plan naming modules the model lacks or styles that do not fit them, ties a pipeline would split
    unevenly, buffers without a rule."""
    if tp > 1:
        if recipe.tp_plan is None:
            raise ConfigError(f"tp = {tp} needs a tensor-parallel plan for a {type(model).__name__}: pass "
                              "tp_plan={module name: style} (see paratrain.tensor_parallel.STYLES) or a recipe, or "
                              "set tp to 1")
        try:
            resolve_plan(model, recipe.tp_plan)
            if pp > 1:  # each stage may hold one end of a tie only
                check_ties(model, recipe.tp_plan)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    buffer_rules(model, buffers)  # refused alike on every rank


def apply_pipeline(model: nn.Module, ctx: Context, recipe: Recipe) -> PipelineLayout | None:
    """pp > 1: this rank's chunks of the recipe's layers (or an nn.Sequential's children); None at pp 1."""
    pp_group = ctx.mesh.groups.get("pp")
    if pp_group is None:
        return None
    cut = (recipe.layers or model_layers)(model)
    v = ctx.config.virtual_stages
    split = ctx.config.pp_split or (layout_split(ctx.config.pp_layout, len(cut)) if ctx.config.pp_layout else None)
    ranges = chunk_ranges(cut, pp_group.size * v, split)
    stage = StageModel(model, cut, ranges, Schedule(ctx.config.schedule, pp_group.size, v), pp_group.index)
    return PipelineLayout(stage, pp_group)


def apply_batch_norm(model: nn.Module, ctx: Context, mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Under dp > 1, 'sync': every BatchNorm's statistics over the forward's samples on every dp rank;
    'local': each rank's own (with a warning). Returns (synced, local) BatchNorm names."""
    dp_group = ctx.mesh.groups.get("dp")
    norms = batch_norms(model)
    if norms and ctx.config.sequence_parallel:
        raise ConfigError(f"the model has BatchNorm ({', '.join(norms[:3])}), and sequence parallelism splits the "
                          "activations between tensor-parallel layers along the sequence, so a BatchNorm there would "
                          "normalise over a slice of each sample: set sequence_parallel=False")
    if dp_group is None or not norms:
        return (), ()
    if mode == "sync":
        return tuple(apply_synced_batch_norm(model, dp_group)), ()
    warnings.warn(f"batch_norm='local': BatchNorm ({', '.join(norms[:3])}) normalises over each rank's own "
                  f"micro-batch, so the loss depends on dp ({dp_group.size}); batch_norm='sync' does not. "
                  "Their running statistics keep dp rank 0's (DDP's broadcast_buffers)", stacklevel=3)
    return (), tuple(norms)


def float8_choice(model: nn.Module, recipe: Recipe, settings: Float8Settings,
                  parallel: ParallelConfig) -> tuple[list[str], dict[str, str]]:
    """Precision fp8's linears (memory.float8.float8_linears: the blocks' nn.Linear, a plan's partial_linear kept
    dense) and the tp plan's style of each module (empty at tp 1), with its rules, pure (paratrain.Trainer runs them
    before launching): the recipe names blocks, tp is not the 3d cube (its blocks are not float8 yet), widths fit."""
    if recipe.blocks is None:
        raise ConfigError(f"precision fp8 makes the linears of a model's blocks float8, and this "
                          f"{type(model).__name__}'s recipe names no blocks: give it blocks (paratrain.recipe_for("
                          "model, blocks=REGEX)) or use bf16")
    check_float8_layout(parallel)
    styles = resolve_plan(model, recipe.tp_plan, allow_missing=True) if parallel.tp > 1 and recipe.tp_plan else {}
    dense = frozenset(name for name, style in styles.items() if style == "partial_linear")
    return float8_linears(model, recipe.blocks, settings, parts=parallel.tp_split, dense=dense), styles


def apply_float8_step(model: nn.Module, ctx: Context, recipe: Recipe, settings: Float8Settings) -> list[str]:
    """Precision fp8: the recipe's blocks' linears multiply in float8, each scale reduced over the groups that
    split its tensor: tp's through the layers' splits; cp's tokens, and under sequence parallelism tp's for a linear
    the plan leaves whole (it runs on the rank's chunk of the sequence, as a MoE layer's shared expert; where it
    runs on the whole sequence the reduction is over equal values). float8_choice's rules, and a GPU older than float8
    refused. Returns the float8 linears' names."""
    names, styles = float8_choice(model, recipe, settings, ctx.config)
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise ConfigError(f"precision fp8 needs float8 matmuls, which NVIDIA GPUs have from compute capability 8.9 "
                          f"(Ada, Hopper); {torch.cuda.get_device_name(ctx.device)} is "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(ctx.device)))}: use bf16")
    cp, tp = ctx.mesh.groups.get("cp"), ctx.mesh.groups.get("tp")
    chunked = (tp,) if ctx.config.sequence_parallel and tp is not None else ()
    apply_float8(model, settings, {name: tuple(g for g in (cp, *(() if name in styles else chunked)) if g is not None)
                                   for name in names})
    return names


def float8_gathers(model: nn.Module, names: list[str]) -> dict[int, AxisGroup | None]:
    """ZeRO-3's float8 gathers (ZeroOptions.float8_gather): each float8 linear's weight, by id, with the tp group
    that splits it too (its scale is the whole weight's: a 1d slice's tp, a grid block's whole grid), None when tp
    leaves it whole."""
    out: dict[int, AxisGroup | None] = {}
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, GridLinear):
            out[id(module.weight)] = module.grid.tp
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            out[id(module.weight)] = module.group
        else:
            out[id(module.weight)] = None
    return out


def apply_tensor_layout(model: nn.Module, ctx: Context, recipe: Recipe, *,
                           staged: bool) -> TensorParallelLayout | GridLayout | None:
    """tp > 1: the recipe's plan applied as 1d slices, or as the blocks of a 2d / 2.5d grid or a 3d cube."""
    tp_group = ctx.mesh.groups.get("tp")
    if tp_group is None or recipe.tp_plan is None:
        return None
    if ctx.mesh.dims.tp_mode != "1d":
        grid = Cube.of(ctx.mesh) if ctx.mesh.dims.tp_mode == "3d" else Grid.of(ctx.mesh)
        return apply_grid_tensor_parallel(model, recipe.tp_plan, grid, allow_missing=staged)
    layout = apply_tensor_parallel(model, recipe.tp_plan, tp_group, sequence_parallel=ctx.config.sequence_parallel,
                                   allow_missing=staged, hooks=False)  # hooked once every layout is applied
    if recipe.tp_local is not None:
        recipe.tp_local(model, tp_group.size)
    if ctx.config.sequence_parallel:  # MoE layers route each tp rank's chunk of the sequence
        route_sequence_chunks(model, tp_group)
    return layout


def apply_expert_layouts(model: nn.Module, ctx: Context,
                         recipe: Recipe) -> tuple[ExpertTensorLayout | None, ExpertLayout | None]:
    """Expert tensor parallelism (expert_tp: every expert cut over tp), then expert parallelism (this ep rank's
    share of the experts: paratrain's MoE layers, or the recipe's expert banks); either is None when off. The cuts
    keep the parameters' identity, so each layout's ids name the parameters that remain."""
    tp_group, ep_group = ctx.mesh.groups.get("tp"), ctx.mesh.groups.get("ep")
    cut = None
    if ctx.config.expert_tp and tp_group is not None:
        cut = apply_expert_tensor_parallel(model, tp_group, rows_differ=ctx.config.sequence_parallel)
    banks = recipe.expert_banks(model) if recipe.expert_banks is not None else None
    shared = apply_expert_parallel(model, ep_group, banks) if ep_group is not None else None
    if cut is not None and shared is not None:  # placed as the experts shared over ep are
        cut = dataclasses.replace(cut, experts=shared)
    return cut, shared


def apply_memory_savers(model: nn.Module, savers: MemorySavers, recipe: Recipe, *, required: bool) -> bool:
    """Recompute, then compile each block (the recomputation inside), then offload its saved activations
    (around the compiled forward). required: a pattern must match (False on a pipeline stage, which may
    hold no block). Returns whether anything is recomputed."""
    recomputed = savers.recompute != "none" and bool(
        apply_recompute(model, recompute_pattern(savers.recompute, recipe), required=required))
    if savers.compile:
        compile_blocks(model, recompute_pattern("full", recipe),
                       backend="inductor" if savers.compile is True else savers.compile, required=required)
    if savers.offload_activations:
        apply_activation_offload(model, recompute_pattern("full", recipe), required=required)
    return recomputed


def placer(model: nn.Module, source: Source | None, pieces: Pieces,
            device: torch.device) -> Callable[..., None]:
    """place(groups=...) allocates and fills this rank's tensors of a meta model (nothing in a dry run)."""
    if device.type == "meta":  # a dry run (paratrain.planner.dryrun): shapes only, nothing to fill
        return lambda groups=(): None
    return functools.partial(materialize, model, source, pieces, device=device)  # type: ignore[arg-type]


@torch.no_grad()
def broadcast_weights(model: nn.Module, placements: Placements, *, across: AxisGroup | None = None) -> None:
    """dp rank 0's weights (and buffers) to the other replicas: cheap, once, and replicas start equal
    even for a model whose init was not layout-free. across: DiLoCo's replica group, whose first group's
    weights the others start from (placements reduce inside a group only)."""
    for tensor in model.parameters():
        for replicas in (placements(tensor).reduce, across):
            if replicas is not None:
                broadcast(tensor.data, replicas)
    for tensor in model.buffers():
        for replicas in (placements.default.reduce, across):
            if replicas is not None:
                broadcast(tensor, replicas)


def pipeline_executor(layout: PipelineLayout, ctx: Context, recipe: Recipe, *, family: str, hidden: int | None,
              policy: Precision, recomputed: bool) -> PipelineExecutor:
    """The pipeline schedule's runner on this rank. family: the whole model's class (for the error);
    hidden: the width of the activation between stages (a dry run's boundary shape)."""
    if recipe.stage_loss is None:
        raise ValueError(f"pp > 1 on a {family} needs the last stage's loss: pass pipeline_loss="
                         "(output, targets) -> (sum, count), or a recipe with its stage_loss")
    boundary = None
    if ctx.device.type == "meta" and hidden is not None:  # a dry run: the activation between stages
        dtype = policy.stored_dtype(sharded=ctx.config.zero > 0)
        tp_group = ctx.mesh.groups.get("tp")
        split = tp_group.size if tp_group is not None and ctx.config.sequence_parallel else 1
        rows, width = ctx.config.tp_row_parts, ctx.config.tp_split if ctx.config.tp_mode != "1d" else 1
        boundary = functools.partial(_boundary, split=split, hidden=hidden // width, rows=rows, dtype=dtype)
    schedule = Schedule(ctx.config.schedule, layout.group.size, ctx.config.virtual_stages)
    return PipelineExecutor(layout.stage, layout.group, schedule=schedule,
                            loss=recipe.stage_loss, device=ctx.device, recomputed=recomputed, boundary_shape=boundary)


def values_source(model: nn.Module, init: Source | Mapping[str, ParamInit] | None) -> Source:
    if init is None:
        param_inits = getattr(model, "param_inits", None)
        if param_inits is None:
            raise ValueError(f"a {type(model).__name__} built on the meta device needs its values: give it a "
                             "param_inits() method (name -> paratrain.models.init.ParamInit), pass init={name: "
                             "ParamInit}, or build it whole on world rank 0 and pass init=FromRank0(model or None, "
                             "ctx.mesh, ctx.device)")
        return Inits(param_inits())
    return Inits(init) if isinstance(init, Mapping) else init


def _boundary(tokens: torch.Size, *, split: int, hidden: int, rows: int = 1,
              dtype: torch.dtype) -> tuple[torch.Size, torch.dtype]:
    """The activation between pipeline stages for micro-batch tokens [rows, seq]: [rows / rows, seq / split,
    hidden] (split: tp under sequence parallelism; rows and hidden: a grid mode's blocks of them)."""
    return torch.Size((tokens[0] // rows, tokens[1] // split, hidden)), dtype


def grad_reduce_op(ctx: Context) -> str:
    if ctx.config.grad_reduce != "auto":
        return ctx.config.grad_reduce
    return "reduce_scatter" if ctx.backend == "nccl" else "all_reduce"


def apply_context_parallel(model: nn.Module, ctx: Context, recipe: Recipe) -> SequenceShard | None:
    """cp > 1: the model runs on this rank's part of each sequence (its recipe's split_sequence routes
    attention, positions, MoE routing and dropout keys through the shard); None at cp 1. Refused, naming
    what is missing: a model whose recipe cannot split its sequence, and BatchNorm (its statistics would
    cover part of each sequence)."""
    group = ctx.mesh.groups.get("cp")
    if group is None:
        return None
    if recipe.split_sequence is None:
        raise ValueError(f"cp = {group.size} needs to know how a {type(model).__name__}'s attention and positions "
                         "follow a split sequence: give its recipe a split_sequence (paratrain.nn.recipe; the GPT's "
                         "is paratrain.models.gpt_recipe.gpt_split_sequence)")
    norms = batch_norms(model)
    if norms:
        raise ConfigError(f"cp = {group.size} with BatchNorm ({', '.join(norms[:3])}): its statistics would cover "
                          "part of each sequence; set cp to 1")
    usp = (ctx.mesh.group("cp_ulysses"), ctx.mesh.group("cp_ring")) if ctx.config.cp_mode == "usp" else None
    shard = SequenceShard(group, ctx.config.cp_mode, usp, ctx.config.cp_balance)
    recipe.split_sequence(model, shard)
    fixed = sorted({getattr(m, "reads_fixed_split", "") for m in model.modules()} - {""}) \
        if shard.balance == "documents" else []
    if fixed:  # (the run's checks say it before launch; this, paratrain.parallelize)
        raise ConfigError(f"cp_balance documents splits each micro-batch by its documents, and this model reads the "
                          f"fixed split: {'; '.join(fixed)}. Set them off (dropout 0, capacity_factor 0, no MTP), or "
                          "use cp_balance positions")
    return shard
