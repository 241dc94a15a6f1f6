"""Where a step's update happens once backward has run (the Update protocol of paratrain.hybrid.parts):

    LocalUpdate    on this rank: the step's totals summed over the data ranks, fp16's overflow decision, the global
                   gradient norm, one pass that divides and clips, the optimizer (every layout but the parameter
                   server's)
    ServedUpdate   on the parameter servers: push the summed gradients with the loss sum, token count, loss scale
                   and learning rates; the servers update and the parameters are pulled back (their statistics)

The engine runs forward and backward alike for both and calls `apply`; checkpoints and the end of the run reach the
servers through the same object (before_save, before_load, after_load, close), so the engine has no branch on where
the optimizer lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import all_reduce, divide_and_clip_, global_grad_norm
from paratrain.hybrid.experts import routing_totals
from paratrain.comm.flat import FlatGroup
from paratrain.hybrid.parts import Stepping
from paratrain.hybrid.pieces import Pieces
from paratrain.hybrid.step import PendingStep
from paratrain.memory.precision import overflowed
from paratrain.optim import Held, MatrixExchange, Matrices, MatrixOptimizer
from paratrain.config.errors import ConfigError
from paratrain.data_parallel.diloco import OuterStep, Span
from paratrain.topology.quorum import Quorum
from paratrain.param_server import ServerClient
from paratrain.topology import AxisGroup, Context

DILOCO_STATE = ("a whole state dict (Engine.state_dict) holds one replica group's state without DiLoCo's outer copy and "
                "momentum: save and resume a dp_mode diloco run through its sharded checkpoints (paratrain.checkpoint)")


@dataclass(frozen=True)
class LocalUpdate:
    """The optimizer steps on this rank, over the gradients the gradient strategy reduced; a matrix optimizer's
    whole-matrix part through `matrices` (paratrain.optim.MatrixExchange: the owners of the matrices the layout
    cut)."""

    matrices: Matrices | None = None
    outer: OuterStep | None = None
    """DiLoCo (dp_mode 'diloco'): the outer step every inner_steps steps, over the replica groups."""
    quorum: Quorum | None = None
    """Fault tolerance (fault_tolerance 'replica'): the loss sum, token count and reduced gradients summed over the
    replica groups of the step's quorum, before anything is applied (paratrain.topology.quorum)."""

    def apply(self, engine: Stepping, totals: torch.Tensor, micro_batches: int, *, wait: bool) -> PendingStep:
        if self.outer is not None:
            self.outer.begin()
        local_loss = totals[0].clone()  # this rank's own, to name it if the step is not finite
        if engine.dp_group is not None:
            all_reduce(totals, engine.dp_group)
        if self.quorum is not None:  # ReplicaLost here leaves the step undone on every rank of the group
            self.quorum.reduce([totals, *engine.grads.owned_grads()])
        if engine.buffers is not None:
            engine.buffers.end_step()
        pending = PendingStep(engine.watch, engine.dropout.advance(), micro_batches, totals, local_loss)
        counts: dict[str, torch.Tensor] = {}
        if engine.router_log is not None:
            pending.routing, counts = routing_totals(engine.router_log, engine.ctx.device, engine.dp_group,
                                                     engine.pp_group, engine.routed_apart, quorum=self.quorum)
        grads = engine.grads.owned_grads()
        scaler = engine.scaler
        scale = scaler.scale if scaler and scaler.scale else 1.0
        if scaler is not None:
            pending.loss_scale = scale
            if overflowed(grads, engine.ctx.device, engine.agree):  # fp16 overflow somewhere: every rank skips
                scaler.update(overflow=True)
                self._after_step(engine, pending.number)
                pending.skipped = True
                return pending
        # The gradients are sums over the global batch (times the loss scale): their norm as means per
        # token is the sums' norm over the divisor; one pass below divides and clips (no tokens:
        # stats() says so).
        divisor = totals[1].clamp(min=1.0) * scale
        pending.grad_norm = global_grad_norm(engine.grads.norm_parts()) / divisor
        if wait or engine.options.on_non_finite == "skip":
            if pending.stats().non_finite:  # "raise" has raised; "skip": every rank skips alike
                self._after_step(engine, pending.number)
                return pending
        else:
            engine.watch.see(pending)
        divide_and_clip_(grads, divisor, pending.grad_norm, engine.options.grad_clip)
        engine.grads.before_optimizer_step()
        if self.matrices is not None:
            cast(MatrixOptimizer, engine.optimizer).step_with(self.matrices)
        else:
            engine.optimizer.step()
        if engine.router_log is not None:  # the biases and load fractions move with the step taken (not a skipped one)
            engine.router_log.after_step(counts)
        self._after_step(engine, pending.number)
        if scaler is not None:
            scaler.update(overflow=False)
        return pending

    def _after_step(self, engine: Stepping, step: int) -> None:
        """Step `step` is over, taken or skipped (DiLoCo's outer step counts steps, so every group meets at the
        same one): the outer step on what the optimizer steps, then the strategy pushes it into the parameters."""
        if self.outer is not None:
            self.outer.after_step(step)
        engine.grads.after_step()

    def before_save(self, step: int) -> None:
        pass

    def before_load(self) -> None:
        if self.outer is not None:
            raise ConfigError(DILOCO_STATE)

    def after_load(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.outer is not None:  # the outer copy and momentum came in with the optimizer's state
            self.outer.restore(optimizer)

    def replicas(self) -> OuterStep | None:
        return self.outer

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ServedUpdate:
    """The parameter servers update (paratrain.param_server.client); the statistics are theirs (asynchronous: this
    trainer's own loss and the newest clock's norm)."""

    client: ServerClient

    def apply(self, engine: Stepping, totals: torch.Tensor, micro_batches: int, *, wait: bool) -> PendingStep:
        scaler = engine.scaler
        scale = scaler.scale if scaler and scaler.scale else 1.0
        loss, tokens = totals.tolist()  # one read of both
        reply = self.client.update(loss=loss, tokens=tokens, scale=scale,
                                   lrs=tuple(float(g["lr"]) for g in engine.optimizer.param_groups))
        reached = torch.tensor([reply.loss, reply.tokens, reply.norm], dtype=torch.float64, device=engine.ctx.device)
        pending = PendingStep(engine.watch, engine.dropout.advance(), micro_batches, reached[:2], totals[0].clone())
        pending.grad_norm, pending.server = reached[2], reply
        if scaler is not None:
            pending.loss_scale, pending.skipped = scale, reply.skipped
            scaler.update(overflow=reply.skipped)  # an overflow anywhere: every server skipped
        elif engine.options.on_non_finite == "raise":
            engine.watch.see(pending)
        engine.grads.after_step()
        return pending

    def before_save(self, step: int) -> None:
        """The servers write their slices of the checkpoint."""
        self.client.save(step)

    def before_load(self) -> None:
        self.client.check_memory_load()

    def after_load(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.client.mark_loaded(step)

    def replicas(self) -> None:
        return None

    def close(self) -> None:
        """The servers' loops return."""
        self.client.stop()


def matrix_exchange(optimizer: MatrixOptimizer, model: nn.Module, pieces: Pieces, groups: Sequence[FlatGroup],
                    ctx: Context) -> MatrixExchange:
    """Where the matrices the optimizer updates are, over every trainer (collective over them, once): its tensors'
    pieces of whole tensors (parameters, slices, ZeRO's flat shards: `groups`)."""
    matrices = {id(t) for t in optimizer.matrix_tensors()}
    held = [Held(o.owner, o.offset, o.length, o.piece.name, o.piece.shape,
                 tuple((e - o.lo, w, n) for e, w, n in o.piece.runs(o.lo, o.lo + o.length)))
            for o in pieces.owners(model, groups) if id(o.owner) in matrices]
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        world = dist.get_world_size()
        group = AxisGroup("world", tuple(range(world)), dist.get_rank(), dist.group.WORLD, ctx.mesh.recorder)
    size = torch.empty(0, dtype=optimizer.matrix_dtype).element_size()
    return MatrixExchange(held, group, dtype=optimizer.matrix_dtype,
                          bucket_elements=max(1, int(ctx.config.bucket_mb * 2**20) // size))


def outer_spans(model: nn.Module, pieces: Pieces, groups: Sequence[FlatGroup],
                fragments: Mapping[str, int]) -> Callable[[list[torch.Tensor]], list[Span]]:
    """Streaming DiLoCo's fragments on what the optimizer steps: each element of those tensors (a parameter, a ZeRO
    shard or master cut through several) in its whole-model parameter's fragment (`fragments`: by name); padding
    in the fragment of the elements before it. Read at the first step (a meta model is materialised by then)."""
    def spans(tensors: list[torch.Tensor]) -> list[Span]:
        index = {id(t): i for i, t in enumerate(tensors)}
        runs: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(tensors))}
        for o in pieces.owners(model, groups):
            if id(o.owner) in index:
                runs[index[id(o.owner)]].append((o.offset, o.length, fragments[o.piece.name]))
        out: list[Span] = []
        for i, t in enumerate(tensors):
            at, fragment = 0, runs[i][0][2] if runs[i] else 0
            for first, n, f in sorted(runs[i]) + [(t.numel(), 0, -1)]:
                if first > at:  # a gap (padding): the fragment before it
                    out.append((i, at, first - at, fragment))
                if n:
                    out.append((i, first, n, f))
                    at, fragment = first + n, f
        return out
    return spans
