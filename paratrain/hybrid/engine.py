"""Engine: one training step of a parallelized model, from this rank's share of the global batch.

    loss = engine.train_step(batch, loss_fn)          # reads the loss back (a host sync on a GPU)
    pending = engine.step(batch, loss_fn)             # queues the step; pending.stats() reads it later

`batch` is this rank's share of the global batch (global_batch / dp samples); the engine cuts it
into micro-batches and accumulates. `loss_fn(model, micro_batch)` returns (sum of per-token losses,
number of tokens). The step's loss is sum / count over the *whole global batch*, and gradients are
divided by the same global count, so the loss and the update do not depend on dp, on the
micro-batch size or on how many tokens each micro-batch holds.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping, Union

import torch
from torch import nn

from paratrain.comm import all_reduce
from paratrain.hybrid.batches import Batch, batch_rows, split_batch, to_device
from paratrain.hybrid.experts import add_step_aux, attach_router_log
from paratrain.hybrid.parts import EngineParts, GradientStrategy, EngineOptions
from paratrain.hybrid.state import model_state
from paratrain.hybrid.step import NonFiniteWatch, PendingStep, StepStats, non_finite_ranks
from paratrain.hybrid.view import MemoryReader, StateView
from paratrain.memory import precision_policy
from paratrain.nn.dropout import KeyedDropout
from paratrain.rng import DropoutStream
from paratrain.comm.flat import FlatGroup, optimizer_state_bytes
from paratrain.topology import Context

__all__ = ["Batch", "Engine", "EngineParts", "GradientStrategy", "LossFn", "EngineOptions", "split_batch"]

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Union[torch.Tensor, int]]]


class Engine:
    """Built by paratrain.parallelize; owns the model, the gradient sync and the optimizer."""

    def __init__(self, model: nn.Module, ctx: Context, parts: EngineParts, options: EngineOptions) -> None:
        self.model = model
        self.ctx = ctx
        self.parts = parts
        self.options = options
        self.optimizer = parts.optimizer
        self.grads = parts.grads
        self.pipeline = parts.pipeline
        self.scaler = parts.scaler
        self.buffers = parts.buffers
        self.pieces = parts.pieces
        self.update = parts.update
        self.policy = precision_policy(options.precision)
        """The precision policy (paratrain.memory.precision): the forward's autocast, ZeRO's storage, loss scaling."""
        self.dp_group = ctx.mesh.data_group()  # dp, or dp x cp: each holds a part of the global batch's tokens
        self.pp_group = ctx.mesh.groups.get("pp")
        self.agree = [g for g in (self.dp_group, ctx.mesh.groups.get("tp"), self.pp_group) if g is not None]
        """Axes over which an fp16 overflow decision, or a non-finite loss's ranks, must be shared."""
        self.watch = NonFiniteWatch(options.on_non_finite, functools.partial(
            non_finite_ranks, rank=ctx.rank, world_size=ctx.world_size, groups=self.agree))
        """Non-finite steps not yet read back (on_non_finite="raise"), and the newest statistics read."""
        self.dropout = DropoutStream(options.seed)
        """Keys every KeyedDropout of the model by (seed, step, module name, global position)."""
        for name, module in model.named_modules():
            if isinstance(module, KeyedDropout):
                module.attach(self.dropout, name)
        self.router_log = attach_router_log(model, routed=parts.routed)
        """The MoE layers' auxiliary losses and routing counts of the step in progress (None: no MoE layer)."""
        self.routed_apart = ctx.mesh.groups.get("tp") if ctx.config.sequence_parallel else None
        """Sequence parallelism: the tp ranks each routed their chunk, so their routing terms add up."""
        self._closed = False

    @property
    def last(self) -> StepStats | None:
        """The statistics of the newest step read back (PendingStep.stats())."""
        return self.watch.last

    micro_batch = property(lambda self: self.options.micro_batch)
    precision = property(lambda self: self.options.precision)

    def train_step(self, batch: Batch, loss_fn: LossFn) -> float:
        """Forward, backward and update on this rank's share of one global batch; returns its loss
        (read back from the device: see step() for a step that does not wait for it)."""
        return self.step(batch, loss_fn, wait=True).stats().loss

    def step(self, batch: Batch, loss_fn: LossFn, *, wait: bool = False, first_row: int | None = None) -> PendingStep:
        """As train_step, without reading anything back to the host: on a GPU the step is queued and
        this returns at once. Its loss, gradient norm and token count stay on the device until
        PendingStep.stats() reads them (read them once per log interval). Two policies must decide
        on the host before the update, so they read once per step: fp16 (was there an overflow) and
        on_non_finite="skip". Under "raise", a step whose loss or gradient norm is not finite is
        found by the next stats() or check() (collective), which raises NonFiniteError naming it:
        the updates in between are not undone, so read before saving a checkpoint.
        wait: read the values before the update (as train_step does): a non-finite step then raises
        or is skipped before it changes anything. first_row: where this rank's rows start in the global batch
        (keyed dropout's positions); None: dp index x rows (replica groups give theirs:
        paratrain.train.fault_tolerance)."""
        self._check_open()
        self.model.train()
        rows = batch_rows(batch)
        micro_batches = split_batch(batch, self.micro_batch or rows)
        if first_row is None:
            first_row = self.ctx.mesh.index("dp") * rows  # this rank's rows of the global batch
        if self.buffers is not None:
            self.buffers.check_micro_batches(len(micro_batches), rows)
            self.buffers.begin_step()
        self.grads.begin_step()
        if self.router_log is not None:
            self.router_log.reset()
        # Accumulate (loss sum, token count) in float64 so the reported loss is exact to print.
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        if self.pipeline is not None:
            totals += self._pipeline_pass(micro_batches, first_row, train=True)
        else:
            for i, micro in enumerate(micro_batches):
                self.grads.begin_micro_batch(sync=i == len(micro_batches) - 1)  # communicate on the last only
                self.dropout.at_rows(first_row + i * batch_rows(micro))
                loss_sum, count = self._forward(self._on_device(micro), loss_fn)
                scale = self.scaler.agreed(float(count), self.ctx.device, self.dp_group) if self.scaler else 1.0
                if self.router_log is not None:  # the MoE layers' auxiliary terms get the loss sum's gradient
                    self.router_log.scale_gradients(scale)
                (loss_sum * scale if self.scaler else loss_sum).backward()
                self.grads.end_backward()
                totals[0] += loss_sum.detach().double()
                totals[1] += count
            add_step_aux(totals, self.router_log, self.routed_apart)  # the auxiliary losses belong to the loss
        self.grads.finish()
        return self.update.apply(self, totals, len(micro_batches), wait=wait)

    def close(self) -> None:
        """The run is over: the update's place is told (the parameter servers' loops return), then the gradient
        strategy's hooks and parallelize's are removed, so that this engine, its process groups and their threads
        are freed once nothing else holds them. Once; later calls do nothing. `with parallelize(...) as engine:`
        closes at the end of the block (after an exception only the hooks are removed: the servers may not answer)."""
        if not self._closed:
            self.update.close()
            self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self.grads.close()
            for handle in self.parts.hooks:
                handle.remove()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed (Engine.close): its gradient hooks are removed, so a step "
                               "would not reduce, and ZeRO-3's forward would not gather; build a new engine with "
                               "paratrain.parallelize")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self._release()

    def before_save(self, step: int) -> None:
        """A checkpoint of `step` steps is being written (the parameter servers write their slices of it)."""
        self.update.before_save(step)

    def check(self) -> None:
        """Raise NonFiniteError if a step since the last check had a loss or gradient norm that was not
        finite (on_non_finite="raise"; one read from the device; collective: call it on every rank)."""
        self.watch.check()

    @torch.no_grad()
    def eval_loss(self, batch: Batch, loss_fn: LossFn) -> float:
        """Mean per-token loss over the global batch (this rank's share given), without updating."""
        self._check_open()
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        micro_batches = split_batch(batch, self.micro_batch or batch_rows(batch))
        if self.pipeline is not None:
            totals += self._pipeline_pass(micro_batches, self.ctx.mesh.index("dp") * batch_rows(batch), train=False)
        else:
            for micro in micro_batches:
                loss_sum, count = self._forward(self._on_device(micro), loss_fn)
                totals[0] += loss_sum.double()
                totals[1] += count
        for group in (self.dp_group, self.ctx.mesh.replica_group()):  # DiLoCo: each group's rows by its weights
            if group is not None:
                all_reduce(totals, group)
        self.model.train()
        return float(totals[0] / totals[1])

    def _pipeline_pass(self, micro_batches: list[Any], first_row: int, *, train: bool) -> torch.Tensor:
        """Run the pipeline schedule (or, not training, its forward program) over the micro-batches:
        (loss sum, token count), both as the loss function computed them on the last stage, summed over pp."""
        assert self.pipeline is not None
        pairs = []
        for micro in micro_batches:
            if not (isinstance(micro, (tuple, list)) and len(micro) in (2, 3)):
                raise TypeError("under pipeline parallelism a batch is (inputs, targets) or (inputs, targets, positions) "
                                "of packed documents: the loss is computed on the last stage from the targets")
            pairs.append(tuple(self._on_device(micro)))
        # The first scale of fp16 comes from the first micro-batch's size, before any rank has run the
        # loss: only the last stage ever knows the loss's own count, and every stage needs the scale.
        scale = (self.scaler.agreed(float(pairs[0][1].numel()), self.ctx.device, self.dp_group)
                 if self.scaler and train else 1.0)
        self.grads.begin_micro_batch(sync=False)  # the schedule interleaves micro-batches: reduce once, in finish()
        if self.router_log is not None:
            self.router_log.scale_gradients(scale)
        with (contextlib.nullcontext() if train else torch.no_grad()), self.policy.casts_once(self.ctx.device):
            totals = self.pipeline.run(pairs, dropout=self.dropout, first_row=first_row, loss_scale=scale,
                                       train=train, forward_context=lambda: self.policy.autocast(self.ctx.device))
        if train:  # this stage's MoE layers' auxiliary losses
            add_step_aux(totals, self.router_log, self.routed_apart)
        assert self.pp_group is not None
        all_reduce(totals, self.pp_group)  # only the last stage computed them
        return totals

    def _on_device(self, micro: Any) -> Any:
        """A micro-batch on this rank's device; under cp, this rank's part of its sequences."""
        micro = to_device(micro, self.ctx.device)
        return micro if self.parts.sequence is None else self.parts.sequence.shard_batch(micro)

    def _forward(self, micro: Any, loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor | int]:
        with self.policy.autocast(self.ctx.device):
            result = loss_fn(self.model, micro)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                "loss_fn(model, micro_batch) must return (sum of per-token losses, token count), "
                f"got {type(result).__name__}; see paratrain.models.lm_loss for the shape"
            )
        return result

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Full and layout-free: model tensors and optimizer state keyed by parameter name.
        Collective under sharding (every rank must call it): shards are gathered."""
        sharded = self.grads.model_state()
        model = {**model_state(self.model, skip=frozenset(sharded)), **sharded}
        optimizer = self.parts.optimizer_state()
        for layout in self.parts.layouts:  # this rank's pieces -> the whole model's (collective over each axis)
            model, optimizer = layout.to_whole(model, optimizer)
        return {"model": model, "optimizer": optimizer, **self.view().scalars()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state_dict() taken under any layout: this rank reads its own pieces of it (the path a
        sharded checkpoint loads by, over the dict in memory)."""
        self.update.before_load()
        reader = MemoryReader(state)
        self.view().load(reader, reader.meta)

    def view(self) -> StateView:
        """This rank's training state as pieces of the whole model (what checkpoints save and load)."""
        return StateView(self.model, self.ctx.mesh, self.optimizer, self.flat_groups, self.pieces,
                         self.parts.placements, self.dropout, self.scaler, self._restarted,
                         replicas=self.update.replicas())

    def _restarted(self) -> None:
        """State was loaded: the gradient strategy starts afresh (the parameter servers loaded theirs)."""
        self.grads.after_step()
        self.update.after_load(self.dropout.step, self.optimizer)

    @property
    def flat_groups(self) -> list[FlatGroup]:
        """ZeRO's flat groups (empty under plain data parallelism)."""
        return list(getattr(self.grads, "groups", []))

    def memory_report(self) -> dict[str, int]:
        """Bytes of this rank's model states: parameters, the gradient buffers a step allocates, optimizer state;
        "in_step" their sum, "between_steps" what stays (the gradients released, unless keep_grads)."""
        report = self.grads.memory()
        report["optimizer"] = optimizer_state_bytes(self.optimizer) + report.pop("masters", 0)
        report["in_step"] = report["params"] + report["grads"] + report["optimizer"]
        report["between_steps"] = report["in_step"] - report["grads"] + report.pop("grads_kept")
        return report
