"""A dedicated parameter server's run: its slices built (paratrain.param_server), resumed from a checkpoint
when the trainers resume, then served until every trainer says STOP, writing its pieces of every checkpoint
the trainers write (one collective save: the servers hold the parameters' exact values and their optimizer
state, the trainers the buffers and the loader's cursor).

    ctx = paratrain.init(paratrain.ParallelConfig(ps_mode="sync", ps_servers=2))
    model = build(...)                       # on the meta device is enough: nothing of it runs here
    if ctx.is_server:
        paratrain.serve(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    else:
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        ...                                  # engine.step / train_step; engine.close() at the end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from paratrain.checkpoint import checkpoint_to_resume, load_sharded, save_sharded
from paratrain.comm.placement import Placement, Placements
from paratrain.config import RunPlan
from paratrain.hybrid import EngineOptions
from paratrain.hybrid.pieces import Pieces, whole_shapes
from paratrain.hybrid.view import StateView
from paratrain.param_server import ShardServer, build_server
from paratrain.param_server.loops import serve_loop
from paratrain.param_server.setup import OptimizerFactory
from paratrain.rng import DropoutStream
from paratrain.topology import Context
from paratrain.train.faults import FaultInjection
from paratrain.train.log import get_logger
from paratrain.train.optim import optimizer_factory


@dataclass
class ServeResult:
    pushes: list[tuple[int, int, int]] = field(default_factory=list)
    """Every push in the order it was applied: (clock, trainer, version it was computed on)."""
    resumed_at: int = 0
    """The step the run resumed from (0: it started afresh)."""
    memory: dict[str, int] = field(default_factory=dict)
    """What the server held at the end (ShardServer.memory(): its slices, their optimizer state, the most
    bytes of pushes held at once)."""


def serve(model: nn.Module, ctx: Context, *, optimizer: OptimizerFactory,
          options: EngineOptions = EngineOptions(), save: str = "", resume: str = "", keep_last: int = 0,
          before_step: Callable[[int], None] | None = None) -> ServeResult:
    """Run this rank as a dedicated parameter server (module docstring). options: the trainers' (the server
    applies their grad_clip and on_non_finite). save, resume, keep_last: the trainers' own (their checkpoints are
    written together: a server writes its pieces of each). before_step: called with each step (1-based) whose
    update is about to be applied."""
    shapes = whole_shapes(model)
    server = build_server(model, ctx, optimizer, grad_clip=options.grad_clip, on_non_finite=options.on_non_finite,
                          before_step=before_step)
    view = server_view(server, model, ctx, shapes)
    result = ServeResult()
    if resume:
        found = checkpoint_to_resume(resume, save)  # collective: the trainers verify it with the servers
        if found is not None:
            folder, meta = found
            load_sharded(folder, meta, view)
            result.resumed_at = int(meta["step"])
            server.loaded(result.resumed_at)

    def write(step: int) -> None:
        save_sharded(save, step, view, {}, keep_last=keep_last)
    get_logger(ctx.rank).info("parameter server %d serves %d slices (%d elements) to %d trainers", server.index,
                              len(server.groups), sum(s.numel() for s in server.slices),
                              server.exchange.peers.trainers)
    mode = ctx.config.ps_mode
    result.pushes = serve_loop(server, staleness=ctx.config.staleness if mode == "async" else None,
                               save=write if save else None)
    result.memory = server.memory()
    return result


def server_view(server: ShardServer, model: nn.Module, ctx: Context, shapes: dict) -> StateView:
    """What a dedicated server saves and loads: its masters (the parameters' exact values over its slices)
    and their optimizer state; no buffer (the trainers hold them)."""
    return StateView(model, ctx.mesh, server.optimizer, server.groups + server.tables, Pieces.of(shapes, ()),
                     Placements(Placement()), DropoutStream(0), None, lambda: None, buffers=False)


def serve_plan(plan: RunPlan, ctx: Context) -> ServeResult:
    """`paratrain train`'s dedicated parameter server: the run's GPT (on the meta device: only the shapes and
    the optimizer's groups are read) and AdamW, its clipping and non-finite policy, the trainers' checkpoints
    (resumed as they resume: the run's --resume, or the newest under --save on a relaunch)."""
    from paratrain.models import build_gpt

    config, train = plan.config, plan.config.train
    model = build_gpt(plan.model, seed=config.seed, device="meta")
    resume = "auto" if config.launch.attempt > 0 else train.resume
    fault = FaultInjection(train.fail_at, rank=ctx.rank, attempt=config.launch.attempt) if train.fail_at else None
    options = EngineOptions(grad_clip=config.optim.grad_clip,
                            on_non_finite="skip" if train.nan_policy == "skip" else "raise")
    return serve(model, ctx, optimizer=optimizer_factory(config.optim), options=options, save=train.save,
                 resume=resume, keep_last=train.keep_last, before_step=fault.at_step if fault is not None else None)
