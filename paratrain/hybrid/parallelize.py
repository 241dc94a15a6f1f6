"""parallelize: the one ordered recipe that turns a single-device model into a training engine.

Each step reads the layout from the Context and applies one strategy; degree 1 of a strategy is a
step that does nothing. Later strategies (tensor, pipeline, sharding) slot into this order.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Mapping

import torch
from torch import nn

from paratrain.comm import broadcast
from paratrain.comm.placement import Placement, Placements
from paratrain.config.errors import ConfigError
from paratrain.data_parallel import (BATCH_NORM_MODES, BufferSync, GradSync, apply_synced_batch_norm, batch_norms,
                                     buffer_rules)
from paratrain.expert_parallel import ExpertLayout, apply_expert_parallel
from paratrain.hybrid.compile import compile_blocks
from paratrain.hybrid.engine import Engine, GradientStrategy
from paratrain.hybrid.materialize import Inits, Source, is_meta, materialize
from paratrain.hybrid.pieces import Pieces, whole_shapes
from paratrain.hybrid.state import load_optimizer_state, optimizer_state
from paratrain.memory import (LOW_DTYPES, PRECISIONS, LossScaler, apply_activation_offload, apply_recompute,
                              recompute_pattern)
from paratrain.models.init import ParamInit
from paratrain.models.recipe import Layer, PipelineLoss, Recipe, recipe_of, stage_loss
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.pipeline.stages import StageModel, chunk_ranges, model_layers
from paratrain.sharding import WrapPolicy, ZeroSync
from paratrain.tensor_parallel import TensorParallelLayout, apply_tensor_parallel, check_ties
from paratrain.topology import Context

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def parallelize(model: nn.Module, ctx: Context, *, optimizer: OptimizerFactory,
                micro_batch: int | None = None, precision: str = "fp32", grad_clip: float = 0.0,
                recompute: bool | str = False, sync_initial_weights: bool = True, wrap: WrapPolicy = None,
                reshard_after_forward: bool | None = None, loss_scale: float | None = None,
                tp_plan: Mapping[str, str] | None = None, seed: int = 0,
                pipeline_loss: PipelineLoss | None = None, on_non_finite: str = "raise",
                compile: bool | str = False, init: Source | Mapping[str, ParamInit] | None = None,
                layers: Callable[[nn.Module], list[Layer]] | None = None, batch_norm: str = "sync",
                buffers: Mapping[str, str] | None = None, recipe: Recipe | None = None) -> Engine:
    """Apply the layout of `ctx` to `model` and return an Engine that trains it.

    optimizer: builds the optimizer from the parameter list (called once, after the layout is applied).
    micro_batch: rows per forward/backward; None: this rank's whole share in one pass.
    precision: 'fp32'; 'bf16' / 'fp16': under zero 0, autocast with float32 weights and gradients;
        under zero >= 1, parameters and gradients stored in the low dtype, float32 masters in the
        sharded optimizer. fp16 adds dynamic loss scaling, starting at `loss_scale` (None: 2^16 per
        token of the first micro-batch).
    grad_clip: clip the global gradient norm to this; 0 disables.
    recompute: 'full' (or True) recomputes each of the recipe's blocks in backward, 'selective' each
        block's attention core (paratrain.memory.recompute); 'none' or False nothing; any other
        string is a regex of module names.
    sync_initial_weights: broadcast dp rank 0's weights, so replicas start equal even for a model
        whose init was not layout-free (cheap, once).
    wrap: ZeRO-3 units, a regex of module names or module class(es); None: the recipe's blocks (none:
        one unit, the whole model).
    reshard_after_forward: ZeRO-3 frees a unit's full parameters after its forward and gathers them
        again for backward; False keeps them from forward to backward (more memory, less traffic).
        None: ctx.config.reshard_after_forward.
    tp_plan: module name -> tensor-parallel style (paratrain.tensor_parallel.plan), used when
        ctx.config.tp > 1; None: the recipe's.
    seed: keys dropout masks (paratrain.nn.dropout); use the run's seed.
    pipeline_loss: with pp > 1, loss(last chunk's output, targets) -> (sum, count) on the last stage;
        None: the recipe's stage loss. Under pp the engine reads batches as (inputs, targets) and the
        loss_fn given to train_step is not called (no single rank holds the whole model).
    on_non_finite: a step whose loss or gradient norm is nan or inf (outside fp16's own skip): 'raise'
        paratrain.hybrid.NonFiniteError on every rank, or 'skip' its update on every rank.
    compile: torch.compile each of the recipe's blocks (True: inductor; a string names another torch.compile
        backend, e.g. 'aot_eager'), after tensor parallelism and recomputation, as torchtitan does:
        each block's forward is compiled in place, so names, ZeRO-3's gathers and the pipeline see the
        same modules. Collectives and keyed dropout run eagerly between the compiled pieces.
    init: for a model built on the meta device (build_gpt(..., device="meta"), or any model built
        under `with torch.device("meta")`): where its values come from. None: the model's own
        `param_inits()` (name -> paratrain.models.init.ParamInit, for every parameter and buffer);
        a mapping of the same; or a paratrain.hybrid.materialize Source such as FromRank0 (world rank 0
        built the model whole). The layout is applied to shapes, then each rank allocates and fills only
        its pieces (paratrain.hybrid.materialize), bit for bit what a whole build would give them.
    layers: with pp > 1, model -> its ordered pipeline layers (paratrain.pipeline.stages.Layer: modules
        by their names in the whole model, and a function that runs them), which the stages are cut
        from; e.g. paratrain.models.hf.llama_layers. None: the recipe's, or an nn.Sequential's children.
    batch_norm: under dp > 1, 'sync' takes every BatchNorm's statistics over the forward's samples on
        every dp rank, as one process with dp x the micro-batch would (layout-free; needs one
        micro-batch per step, refused otherwise); 'local' keeps each rank's own (DDP's default: the
        loss then depends on dp). paratrain.data_parallel.batch_norm.
    buffers: under dp > 1, buffer name or glob -> 'rank0' | 'sum' | 'mean': how a persistent buffer
        that forward changes is kept equal over the dp ranks after each step (default 'rank0', with
        a warning naming the buffer). paratrain.data_parallel.buffers.
    recipe: what the strategies need to know about the model's family (paratrain.models.recipe:
        tp plan, blocks, pipeline layers and loss); None: the model's own `recipe()` (the GPT's), or
        none. tp_plan, wrap, layers and pipeline_loss given here replace the recipe's.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1 or None, got {micro_batch}")
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
    recipe = (recipe or recipe_of(model)).with_overrides(
        tp_plan=tp_plan, layers=layers, stage_loss=None if pipeline_loss is None else stage_loss(pipeline_loss))
    blocks = wrap if wrap is not None else recipe.blocks  # ZeRO-3's units
    meta = is_meta(model)
    if init is not None and not meta:
        raise ValueError("init= is for a model built on the meta device; this model already holds its values")
    whole = whole_shapes(model)
    source = _source(model, init) if meta else None
    tp_group = ctx.mesh.groups.get("tp")
    if tp_group is not None:
        if recipe.tp_plan is None:
            raise ValueError(f"tp = {tp_group.size} needs a tensor-parallel plan for a {type(model).__name__}: "
                             "pass tp_plan={module name: style} (see paratrain.tensor_parallel.STYLES)")
        if ctx.mesh.groups.get("pp") is not None:  # on the whole model: each stage may hold one end of a tie only
            check_ties(model, recipe.tp_plan)
    buffer_rules(model, buffers or {})  # on the whole model too: refused alike on every rank
    # 1. Pipeline: this rank keeps the layers of its chunks, under their names in the whole model.
    pp_group = ctx.mesh.groups.get("pp")
    stage: StageModel | None = None
    hidden: int | None = None
    if pp_group is not None:
        cut = (recipe.layers or model_layers)(model)
        hidden = recipe.hidden_size(model) if recipe.hidden_size is not None else None
        v = ctx.config.virtual_stages
        ranges = chunk_ranges(cut, pp_group.size * v, ctx.config.pp_split or None)
        stage = StageModel(model, cut, ranges, [pp_group.index + k * pp_group.size for k in range(v)])
        model = stage
    # 2. Place the model on this rank's device (a meta model is materialised below, piece by piece).
    if not meta:
        model.to(ctx.device)
    # 2b. Batch statistics: every BatchNorm normalises over the forward's samples on all dp ranks.
    dp_group = ctx.mesh.groups.get("dp")
    norms = batch_norms(model)
    if norms and ctx.config.sequence_parallel:
        raise ConfigError(f"the model has BatchNorm ({', '.join(norms[:3])}), and sequence parallelism splits the "
                          "activations between tensor-parallel layers along the sequence, so a BatchNorm there would "
                          "normalise over a slice of each sample: set sequence_parallel=False")
    synced: tuple[str, ...] = ()
    local: tuple[str, ...] = ()
    if dp_group is not None and norms:
        if batch_norm == "sync":
            synced = tuple(apply_synced_batch_norm(model, dp_group))
        else:
            local = tuple(norms)
            warnings.warn(f"batch_norm='local': BatchNorm ({', '.join(norms[:3])}) normalises over each rank's own "
                          f"micro-batch, so the loss depends on dp ({dp_group.size}); batch_norm='sync' does not. "
                          "Their running statistics keep dp rank 0's (DDP's broadcast_buffers)", stacklevel=2)
    # 3. Tensor parallelism: planned modules replaced by slices of themselves, by name.
    tp: TensorParallelLayout | None = None
    if tp_group is not None and recipe.tp_plan is not None:
        tp = apply_tensor_parallel(model, recipe.tp_plan, tp_group, sequence_parallel=ctx.config.sequence_parallel,
                                   allow_missing=stage is not None)
    # 3b. Expert parallelism: each ep rank keeps its share of every MoE layer's experts.
    experts: ExpertLayout | None = None
    ep_group = ctx.mesh.groups.get("ep")
    if ep_group is not None:
        experts = apply_expert_parallel(model, ep_group)
    # 4. By module name: recompute (activation checkpointing); compile each block (its forward, with
    # the recomputation inside); offload each block's saved activations (around the compiled forward).
    if recompute is True:
        recompute = "full"
    recomputed = bool(recompute and recompute != "none" and apply_recompute(
        model, recompute_pattern(recompute, recipe), required=stage is None))
    if compile:
        compile_blocks(model, recompute_pattern("full", recipe), backend="inductor" if compile is True else compile,
                       required=stage is None)
    if "activations" in ctx.config.offloaded:
        apply_activation_offload(model, recompute_pattern("full", recipe), required=stage is None)
    # 5. A meta model: this rank's tensors allocated and filled (ZeRO's flat groups once they exist).
    splits: dict[str, tuple[int, int, int]] = {}
    if tp is not None and tp_group is not None:
        splits = {name: (dim, tp_group.index, tp_group.size) for name, dim in tp.split_dims.items()}
    axis = dict.fromkeys(splits, "tp")
    if experts is not None:
        splits.update(experts.splits)
        axis.update(dict.fromkeys(experts.splits, "ep"))
    pieces = Pieces(whole, tied=stage.tied if stage is not None else {}, splits=splits, split_axis=axis)
    if ctx.device.type == "meta":  # a dry run (paratrain.planner.dryrun): shapes only, nothing to fill
        place = functools.partial(lambda groups=(): None)
    else:
        place = functools.partial(materialize, model, source, pieces, device=ctx.device)  # type: ignore[arg-type]
    if meta and ctx.config.zero == 0:
        place()
        if tp is not None:
            tp.register_grad_hooks(model)
    # 6. Where each parameter's gradient is reduced, sharded and counted in the norm: replicated over dp
    # on its pipeline stage, unless a strategy above placed it otherwise (tp slices, ep's experts, ties).
    placements = _placements(model, ctx, tp, experts, stage)
    # Same weights on every replica, gradients summed over the replicas in buckets.
    if sync_initial_weights and not meta:
        with torch.no_grad():
            for tensor in model.parameters():
                replicas = placements(tensor).reduce
                if replicas is not None:
                    broadcast(tensor.data, replicas)
            for tensor in model.buffers():
                if placements.default.reduce is not None:
                    broadcast(tensor, placements.default.reduce)
    # Buffers that forward changes (BatchNorm's under 'local', a user's counter) kept equal over dp.
    buffer_sync = None if dp_group is None else BufferSync(model, dp_group, buffers or {}, device=ctx.device,
                                                           synced_batch_norms=synced, local_batch_norms=local)
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    bucket_bytes = int(ctx.config.bucket_mb * 2**20)
    opt = optimizer(params)
    grads: GradientStrategy
    if ctx.config.zero == 0:
        # 7a. Plain DP: .grad are bucket views, summed over dp; the optimizer keeps full state.
        grads = GradSync(params, placements, bucket_bytes=bucket_bytes)
        save_state = functools.partial(optimizer_state, opt, names)
        load_state = functools.partial(load_optimizer_state, opt, names=names)
    else:
        # 7b. ZeRO-1/2/3: flat groups padded to the shard group; the optimizer is re-pointed at this
        # rank's shard of each, so its state exists for 1/shard of the parameters only.
        zero = ZeroSync(params, opt, names, stage=ctx.config.zero, bucket_bytes=bucket_bytes,
                        reduce_op=_grad_reduce(ctx), model=model, wrap=blocks,
                        reshard_after_forward=(ctx.config.reshard_after_forward if reshard_after_forward is None
                                               else reshard_after_forward),
                        offload="optimizer" in ctx.config.offloaded,
                        param_dtype=LOW_DTYPES.get(precision), placements=placements, deferred=stage is not None,
                        device=ctx.device)
        if meta:
            place(groups=zero.groups)
            if tp is not None:
                tp.register_grad_hooks(model)
        grads, save_state, load_state = zero, zero.optimizer_state, zero.load_optimizer_state
    # 8. fp16: dynamic loss scaling, its overflow decision shared by all ranks.
    scaler = LossScaler(scale=loss_scale) if precision == "fp16" else None
    # 9. Pipeline: the executor that runs the schedule's actions on this rank.
    executor = None
    if stage is not None:
        assert pp_group is not None
        if recipe.stage_loss is None:
            raise ValueError(f"pp > 1 on a {type(model).__name__} needs the last stage's loss: pass pipeline_loss="
                             "(output, targets) -> (sum, count), or a recipe with its stage_loss")
        boundary = None
        if ctx.device.type == "meta" and hidden is not None:  # a dry run: the activation between stages
            dtype = LOW_DTYPES.get(precision, torch.float32) if ctx.config.zero else torch.float32
            split = tp_group.size if tp_group is not None and ctx.config.sequence_parallel else 1
            boundary = functools.partial(_boundary, split=split, hidden=hidden, dtype=dtype)
        executor = PipelineExecutor(stage, pp_group, schedule=ctx.config.schedule, chunks=ctx.config.virtual_stages,
                                    loss=recipe.stage_loss, device=ctx.device, recomputed=recomputed,
                                    boundary_shape=boundary)
    return Engine(model, ctx, opt, grads, micro_batch=micro_batch, precision=precision, grad_clip=grad_clip,
                  optimizer_state=save_state, load_optimizer_state=load_state, scaler=scaler, tp=tp, seed=seed,
                  pipeline=executor, on_non_finite=on_non_finite, pieces=pieces, experts=experts,
                  buffers=buffer_sync)


def _placements(model: nn.Module, ctx: Context, tp: TensorParallelLayout | None, experts: ExpertLayout | None,
                stage: StageModel | None) -> Placements:
    dense = Placement.data_parallel(ctx.mesh)
    kinds: list[tuple[Placement, frozenset[int]]] = []
    if tp is not None:
        kinds.append((dense.split_over(ctx.mesh.group("tp")), tp.split_ids))
    if experts is not None:
        kinds.append((experts.placement(dense, ctx.mesh.groups.get("edp")), experts.ids))
    placements = Placements(dense, kinds)
    if stage is not None and stage.tied_name is not None:  # the last stage's copy counts in the norm once
        placements.tie(model.get_parameter(stage.tied_name), ctx.mesh.groups.get("tied"), counted=not stage.tied)
    return placements


def _source(model: nn.Module, init: Source | Mapping[str, ParamInit] | None) -> Source:
    if init is None:
        param_inits = getattr(model, "param_inits", None)
        if param_inits is None:
            raise ValueError(f"a {type(model).__name__} built on the meta device needs its values: give it a "
                             "param_inits() method (name -> paratrain.models.init.ParamInit), pass init={name: "
                             "ParamInit}, or build it whole on world rank 0 and pass init=FromRank0(model or None, "
                             "ctx.mesh, ctx.device)")
        return Inits(param_inits())
    return Inits(init) if isinstance(init, Mapping) else init


def _boundary(tokens: torch.Size, *, split: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Size, torch.dtype]:
    """The activation between pipeline stages for micro-batch tokens [rows, seq]: [rows, seq / split,
    hidden] (split: tp under sequence parallelism)."""
    return torch.Size((tokens[0], tokens[1] // split, hidden)), dtype


def _grad_reduce(ctx: Context) -> str:
    if ctx.config.grad_reduce != "auto":
        return ctx.config.grad_reduce
    return "reduce_scatter" if ctx.backend == "nccl" else "all_reduce"
