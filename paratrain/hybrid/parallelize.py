"""parallelize: the one ordered recipe that turns a single-device model into a training engine.

Each step reads the layout from the Context and applies one strategy, in this order (as torchtitan
composes): pipeline cut, batch statistics, tensor, experts (cut over tp, shared over ep), context,
memory savers, gradients (plain or ZeRO), loss scaling, pipeline executor. A step at degree 1 does
nothing. The steps that split the model's state (pipeline, tensor, experts) return a
paratrain.state_layout.StateLayout; placements,
pieces, materialisation, the engine's state_dict and checkpoints loop over those, so a new axis adds
a step and its layout, and nothing that reads them changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import torch
from torch import nn

from paratrain.comm.placement import Placement, Placements
from paratrain.data_parallel import BATCH_NORM_MODES, BufferSync, GradSync
from paratrain.hybrid.engine import Engine
from paratrain.hybrid.materialize import Source, is_meta
from paratrain.hybrid.parts import EngineParts, GradientStrategy, StepOptions, Update
from paratrain.hybrid.pieces import Pieces, whole_shapes
from paratrain.hybrid.state import optimizer_state
from paratrain.hybrid.update import LocalUpdate, ServedUpdate
from paratrain.hybrid.steps import (MemorySavers, apply_batch_norm, apply_context_parallel, apply_expert_layouts,
                                    apply_memory_savers, apply_pipeline,
                                    apply_tensor_layout, broadcast_weights, check_whole_model, grad_reduce_op,
                                    pipeline_executor, placer, values_source)
from paratrain.memory import LOW_DTYPES, LossScaler
from paratrain.models.init import ParamInit
from paratrain.nn.moe import MoE
from paratrain.param_server import ServerClient, connect
from paratrain.nn.recipe import Layer, PipelineLoss, Recipe, recipe_for
from paratrain.sharding import WrapPolicy, ZeroOptions, ZeroSync
from paratrain.sharding.state import ShardedState
from paratrain.state_layout import StateLayout
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
    recipe: what the strategies need to know about the model's family (paratrain.nn.recipe:
        tp plan, blocks, pipeline layers and loss); None: the model's own `recipe()` (the GPT's), or
        none. tp_plan, wrap, layers and pipeline_loss given here replace the recipe's.
    """
    if ctx.is_server:
        raise ValueError(f"rank {ctx.rank} is a dedicated parameter server (the ranks after the {ctx.dims.grid_size} "
                         "trainers): it trains nothing; run paratrain.serve(model, ctx, optimizer=...) "
                         "there instead of parallelize")
    options = StepOptions(micro_batch=micro_batch, precision=precision, grad_clip=grad_clip, seed=seed,
                          on_non_finite=on_non_finite)
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
    recipe = recipe_for(model, recipe, tp_plan=tp_plan, layers=layers, pipeline_loss=pipeline_loss)
    savers = MemorySavers(recompute="full" if recompute is True else (recompute or "none"), compile=compile,
                          offload_activations="activations" in ctx.config.offloaded)
    meta = is_meta(model)
    if init is not None and not meta:
        raise ValueError("init= is for a model built on the meta device; this model already holds its values")
    whole = whole_shapes(model)
    source = values_source(model, init) if meta else None
    check_whole_model(model, recipe, tp=ctx.config.tp, pp=ctx.config.pp, buffers=buffers or {})
    routed = any(isinstance(m, MoE) for m in model.modules())  # of the whole model, before a pipeline cut
    # 1. Pipeline: this rank keeps the layers of its chunks, under their names in the whole model.
    stage = apply_pipeline(model, ctx, recipe)
    hidden = recipe.hidden_size(model) if stage is not None and recipe.hidden_size is not None else None
    family = type(model).__name__
    model = stage.stage if stage is not None else model
    # 2. Place the model on this rank's device (a meta model is materialised below, piece by piece).
    if not meta:
        model.to(ctx.device)
    # 3. Batch statistics: every BatchNorm normalises over the forward's samples on all dp ranks.
    synced, local = apply_batch_norm(model, ctx, batch_norm)
    # 4. Tensor parallelism: planned modules replaced by slices of themselves, by name.
    tp = apply_tensor_layout(model, ctx, recipe, staged=stage is not None)
    # 5. Experts: each cut over tp (expert_tp), then each ep rank keeps its share of every MoE layer's.
    expert_cut, experts = apply_expert_layouts(model, ctx)
    cut_over_tp = expert_cut.split_ids if expert_cut is not None else frozenset()
    hooks = []  # Engine.close removes them
    if tp is not None and not meta:  # sequence parallelism: replicated parameters' gradients summed over tp
        hooks += tp.register_grad_hooks(model, split=cut_over_tp)
    # 5b. Context parallelism: each rank runs on its part of every sequence (no state is split).
    sequence = apply_context_parallel(model, ctx, recipe)
    layouts: tuple[StateLayout, ...] = tuple(x for x in (tp, experts, expert_cut, stage) if x is not None)
    # 6. By module name: recompute, compile each block, offload each block's saved activations.
    recomputed = apply_memory_savers(model, savers, recipe, required=stage is None)
    # 7. Where each parameter's gradient is reduced, sharded and counted in the norm: replicated over dp
    # on its pipeline stage, unless a layout above placed it otherwise (tp slices, ep's experts, ties).
    placements = Placements(Placement.data_parallel(ctx.mesh))
    for layout in layouts:
        layout.place(placements, ctx.mesh)
    if ctx.config.ps_mode != "off" and ctx.dims.servers:  # dedicated servers hold and write them
        placements.add(dataclasses.replace(placements.default, served=True),
                       [id(p) for p in model.parameters() if p.requires_grad])
    pieces = Pieces.of(whole, layouts)
    place = placer(model, source, pieces, ctx.device)
    if meta and ctx.config.zero == 0 and ctx.config.ps_mode == "off":
        place()
        if tp is not None:
            hooks += tp.register_grad_hooks(model, split=cut_over_tp)
    if sync_initial_weights and not meta:  # the same weights on every replica
        broadcast_weights(model, placements)
    # Buffers that forward changes (BatchNorm's under 'local', a user's counter) kept equal over dp.
    dp_group = ctx.mesh.data_group()
    buffer_sync = None if dp_group is None else BufferSync(model, dp_group, buffers or {}, device=ctx.device,
                                                           synced_batch_norms=synced, local_batch_norms=local)
    # 8. Gradients: summed over the replicas in buckets, or ZeRO-1/2/3's flat groups.
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    bucket_bytes = int(ctx.config.bucket_mb * 2**20)
    opt = optimizer(params)
    grads: GradientStrategy
    update: Update = LocalUpdate()
    if ctx.config.ps_mode != "off":  # 8b. the parameter server: pushes and pulls instead of collectives
        if meta:
            place()
        grads = client = connect(model, ctx, opt, grad_clip=grad_clip, on_non_finite=on_non_finite)
        update = ServedUpdate(client)
        save_state = functools.partial(server_optimizer_state, client, opt, names, ctx)
    elif ctx.config.zero == 0:
        grads = GradSync(params, placements, bucket_bytes=bucket_bytes, keep_grads=ctx.config.keep_grads)
        save_state = functools.partial(optimizer_state, opt, names)
    else:  # the optimizer is re-pointed at this rank's shard of each flat group
        zero = ZeroOptions(stage=ctx.config.zero, bucket_bytes=bucket_bytes, reduce_op=grad_reduce_op(ctx),
                           reshard_after_forward=(ctx.config.reshard_after_forward if reshard_after_forward is None
                                                  else reshard_after_forward),
                           offload="optimizer" in ctx.config.offloaded, param_dtype=LOW_DTYPES.get(precision),
                           deferred=stage is not None, keep_grads=ctx.config.keep_grads)
        grads = ZeroSync(params, opt, names, zero, model=model, wrap=wrap if wrap is not None else recipe.blocks,
                         placements=placements, device=ctx.device)
        if meta:
            place(groups=grads.groups)
            if tp is not None:
                hooks += tp.register_grad_hooks(model, split=cut_over_tp)
        save_state = grads.optimizer_state
    # 9. fp16: dynamic loss scaling, its overflow decision shared by all ranks.
    scaler = LossScaler(scale=loss_scale) if precision == "fp16" else None
    # 10. Pipeline: the executor that runs the schedule's actions on this rank.
    executor = None if stage is None else pipeline_executor(stage, ctx, recipe, family=family, hidden=hidden,
                                                    precision=precision, recomputed=recomputed)
    parts = EngineParts(opt, grads, save_state, pieces, placements, update, layouts=layouts, pipeline=executor,
                        scaler=scaler, buffers=buffer_sync, sequence=sequence, hooks=tuple(hooks), routed=routed)
    return Engine(model, ctx, parts, options)


def server_optimizer_state(client: ServerClient, optimizer: torch.optim.Optimizer, names: dict[int, str],
                           ctx: Context) -> dict[str, Any]:
    """The optimizer state under the parameter server, by name: colocated, every trainer's slices gathered
    (as ZeRO's); with dedicated servers none here (the servers hold it: checkpoints carry it)."""
    if client.local is None:
        return optimizer_state(optimizer, names)
    group = ctx.mesh.data_group()
    return ShardedState(client.buckets, [Placement(shard=group)] * len(client.buckets), optimizer,
                        names).optimizer_state()
