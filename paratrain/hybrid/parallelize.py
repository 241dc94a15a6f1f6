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
from paratrain.config.errors import ConfigError
from paratrain.data_parallel import BufferSync, GradSync, OuterSettings, OuterStep, optimizer_tensors
from paratrain.data_parallel.diloco import fragment_of
from paratrain.hybrid.engine import Engine
from paratrain.hybrid.materialize import Source, is_meta
from paratrain.hybrid.parts import EngineOptions, EngineParts, GradientStrategy, Update
from paratrain.hybrid.pieces import Pieces, whole_shapes
from paratrain.hybrid.state import optimizer_state
from paratrain.hybrid.update import LocalUpdate, ServedUpdate, matrix_exchange, outer_spans
from paratrain.hybrid.steps import (MemorySavers, apply_batch_norm, apply_context_parallel, apply_expert_layouts,
                                    apply_float8_step, apply_memory_savers, float8_gathers, apply_pipeline,
                                    apply_tensor_layout, broadcast_weights, check_whole_model, grad_reduce_op,
                                    pipeline_executor, placer, values_source)
from paratrain.memory import precision_policy
from paratrain.models.init import ParamInit
from paratrain.nn.moe import MoE
from paratrain.optim import MatrixOptimizer, NamedFactory
from paratrain.optim.matrices import check_layout_fits
from paratrain.param_server import ServerClient, connect
from paratrain.nn.recipe import Recipe, recipe_for
from paratrain.sharding import ZeroOptions, ZeroSync
from paratrain.sharding.state import ShardedState
from paratrain.state_layout import StateLayout
from paratrain.topology import Context

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def parallelize(model: nn.Module, ctx: Context, *, optimizer: OptimizerFactory,
                options: EngineOptions = EngineOptions(), recipe: Recipe | None = None,
                init: Source | Mapping[str, ParamInit] | None = None) -> Engine:
    """Apply the layout of `ctx` to `model` and return an Engine that trains it.

    optimizer: builds the optimizer from the parameter list (called once, after the layout is applied).
    options: how the engine is built and steps (paratrain.EngineOptions documents each: micro-batch, precision,
        clipping, recomputation, compilation, ZeRO-3's units, batch statistics, ...).
    recipe: what the strategies need to know about the model's family (paratrain.nn.recipe: tp plan, blocks,
        pipeline layers and loss); None: the model's own `recipe()` (the GPT's), or none.
        `paratrain.recipe_for(model, tp_plan=..., layers=..., pipeline_loss=...)` replaces some of the model's own:
        under pp > 1 the engine reads batches as (inputs, targets) and the loss is the recipe's stage loss on the
        last stage (the loss_fn given to train_step is not called: no single rank holds the whole model); layers
        gives the ordered pipeline layers the stages are cut from (paratrain.pipeline.stages.Layer; e.g.
        paratrain.models.hf.llama_layers; None: an nn.Sequential's children).
    init: for a model built on the meta device (build_gpt(..., device="meta"), or any model built
        under `with torch.device("meta")`): where its values come from. None: the model's own
        `param_inits()` (name -> paratrain.models.init.ParamInit, for every parameter and buffer);
        a mapping of the same; or a paratrain.hybrid.materialize Source such as FromRank0 (world rank 0
        built the model whole). The layout is applied to shapes, then each rank allocates and fills only
        its pieces (paratrain.hybrid.materialize), bit for bit what a whole build would give them.
    """
    if ctx.is_server:
        raise ValueError(f"rank {ctx.rank} is a dedicated parameter server (the ranks after the {ctx.dims.grid_size} "
                         "trainers): it trains nothing; run paratrain.serve(model, ctx, optimizer=...) "
                         "there instead of parallelize")
    recipe = recipe_for(model, recipe)
    policy = precision_policy(options.precision)
    recompute = options.recompute
    savers = MemorySavers(recompute="full" if recompute is True else (recompute or "none"), compile=options.compile,
                          offload_activations="activations" in ctx.config.offloaded)
    meta = is_meta(model)
    if init is not None and not meta:
        raise ValueError("init= is for a model built on the meta device; this model already holds its values")
    whole = whole_shapes(model)
    sizes = [(name, p.numel()) for name, p in model.named_parameters()]  # the whole model's, in order
    source = values_source(model, init) if meta else None
    check_whole_model(model, recipe, tp=ctx.config.tp, pp=ctx.config.pp, buffers=options.buffers or {})
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
    synced, local = apply_batch_norm(model, ctx, options.batch_norm)
    # 3b. Float8: the blocks' linears multiply in float8 (before tensor parallelism, whose slices keep the kernel).
    float8 = apply_float8_step(model, ctx, recipe, options.fp8) if policy.float8 else []
    # 4. Tensor parallelism: planned modules replaced by slices of themselves, by name.
    tp = apply_tensor_layout(model, ctx, recipe, staged=stage is not None)
    # 5. Experts: each cut over tp (expert_tp), then each ep rank keeps its share of every MoE layer's.
    expert_cut, experts = apply_expert_layouts(model, ctx, recipe)
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
    if options.sync_initial_weights and not meta:  # the same weights on every replica
        broadcast_weights(model, placements, across=ctx.mesh.replica_group())
    # Buffers that forward changes (BatchNorm's under 'local', a user's counter) kept equal over dp.
    dp_group = ctx.mesh.data_group()
    buffer_sync = None if dp_group is None else BufferSync(model, dp_group, options.buffers or {}, device=ctx.device,
                                                           synced_batch_norms=synced, local_batch_norms=local)
    # 8. Gradients: summed over the replicas in buckets, or ZeRO-1/2/3's flat groups.
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    bucket_bytes = int(ctx.config.bucket_mb * 2**20)
    opt = optimizer.named([(names[id(p)], p) for p in params]) if isinstance(optimizer, NamedFactory) \
        else optimizer(params)
    matrix = isinstance(opt, MatrixOptimizer)
    cuts = [what for what, cut in ((f"ZeRO-{ctx.config.zero}'s flat shards", ctx.config.zero > 0),
                                   ("tensor-parallel slices", ctx.config.tp > 1), ("expert shards", ctx.dims.experts_split),
                                   ("the parameter server's slices", ctx.config.ps_mode != "off")) if cut]
    check_layout_fits(opt, cuts)
    grads: GradientStrategy
    # replica groups (not DiLoCo's, which meet at outer steps only): their sums over the quorum each step
    per_step = ctx.replicas if ctx.config.dp_mode != "diloco" else None
    update: Update = LocalUpdate(quorum=per_step)
    if ctx.config.ps_mode != "off":  # 8b. the parameter server: pushes and pulls instead of collectives
        if meta:
            place()
        grads = client = connect(model, ctx, opt, grad_clip=options.grad_clip,
                                 on_non_finite=options.on_non_finite)
        update = ServedUpdate(client)
        save_state = functools.partial(server_optimizer_state, client, opt, names, ctx)
    elif ctx.config.zero == 0:
        grads = GradSync(params, placements, bucket_bytes=bucket_bytes, keep_grads=ctx.config.keep_grads)
        save_state = functools.partial(optimizer_state, opt, names)
    else:  # the optimizer is re-pointed at this rank's shard of each flat group
        zero = ZeroOptions(stage=ctx.config.zero, bucket_bytes=bucket_bytes, reduce_op=grad_reduce_op(ctx),
                           reshard_after_forward=(ctx.config.reshard_after_forward
                                                  if options.reshard_after_forward is None
                                                  else options.reshard_after_forward),
                           offload="optimizer" in ctx.config.offloaded, param_dtype=policy.stored,
                           grad_dtype=precision_policy(options.grad_dtype).compute if policy.stored else None,
                           reduce_dtype=(precision_policy(options.grad_reduce_dtype).compute
                                         if policy.stored and options.grad_reduce_dtype else None),
                           deferred=stage is not None, keep_grads=ctx.config.keep_grads,
                           float8_gather=float8_gathers(model, float8) if options.fp8.gathers_float8 else {})
        wrap = options.wrap if options.wrap is not None else recipe.blocks
        grads = ZeroSync(params, opt, names, zero, model=model, wrap=wrap,
                         placements=placements, device=ctx.device)
        if meta:
            place(groups=grads.groups)
            if tp is not None:
                hooks += tp.register_grad_hooks(model, split=cut_over_tp)
        save_state = grads.optimizer_state
    if matrix:  # 8c. each matrix gets an owner that runs its whole-matrix step
        if ctx.config.dp_mode == "diloco":
            raise ConfigError("dp_mode diloco with a matrix optimizer (Muon): its matrices' owners are spread over "
                              "every rank, and DiLoCo's replica groups train apart: use AdamW or SGD inside the "
                              "groups, or dp_mode sync")
        update = LocalUpdate(matrix_exchange(opt, model, pieces, grads.groups if isinstance(grads, ZeroSync) else [],
                                             ctx), quorum=per_step)  # the groups' sums precede the owners' step
    if ctx.config.dp_mode == "diloco":  # 8d. the replica groups' outer step every inner_steps steps (by fragments;
        # under fault tolerance the groups are worlds of their own, meeting over the quorum at outer steps only)
        settings = OuterSettings(ctx.config.inner_steps, ctx.config.outer_lr, ctx.config.outer_momentum,
                                 ctx.config.outer_fragments)
        spans = None if settings.fragments == 1 else outer_spans(
            model, pieces, grads.groups if isinstance(grads, ZeroSync) else [], fragment_of(sizes, settings.fragments))
        update = LocalUpdate(outer=OuterStep(optimizer_tensors(opt), ctx.mesh.replica_group(), settings,
                                             bucket_elements=bucket_bytes // 4, spans=spans, quorum=ctx.replicas))
    # 9. Loss scaling where the policy needs it (fp16), its overflow decision shared by all ranks.
    scaler = policy.scaler(options.loss_scale, across=per_step)
    # 10. Pipeline: the executor that runs the schedule's actions on this rank.
    executor = None if stage is None else pipeline_executor(stage, ctx, recipe, family=family, hidden=hidden,
                                                    policy=policy, recomputed=recomputed)
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
