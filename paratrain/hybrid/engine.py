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
from typing import Any, Callable, Mapping, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import NormPart, all_reduce, divide_and_clip_, global_grad_norm
from paratrain.data_parallel import BufferSync
from paratrain.expert_parallel import ExpertLayout
from paratrain.hybrid.experts import attach_router_log, routing_totals
from paratrain.hybrid.pieces import Pieces, whole_shapes
from paratrain.hybrid.state import load_model_state, model_state
from paratrain.hybrid.step import NonFiniteWatch, PendingStep, StepStats
from paratrain.memory import LossScaler, autocast
from paratrain.nn.dropout import KeyedDropout
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.pipeline.stages import gather_stages, stage_part
from paratrain.rng import DropoutStream
from paratrain.sharding.flat import FlatGroup
from paratrain.tensor_parallel import TensorParallelLayout
from paratrain.topology import Context

Batch = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor]]
LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Union[torch.Tensor, int]]]


class GradientStrategy(Protocol):
    """How a strategy reduces gradients (paratrain.data_parallel.GradSync, paratrain.sharding.ZeroSync).

    The engine calls, per step: begin_step(); per micro-batch: begin_micro_batch(sync=...), backward,
    end_backward();
    then finish() (gradients reduced), owned_grads() (divided by the token count, normed as
    norm_parts() say, clipped), before_optimizer_step(), the optimizer step, and after_step().
    """

    def begin_micro_batch(self, *, sync: bool) -> None:
        """sync False: the coming backward only accumulates (the strategy may still communicate); True:
        the step's last, which reduces."""
        ...

    def norm_parts(self) -> list[NormPart]:
        """owned_grads() grouped by the axes across which ranks hold different pieces of them."""
        ...

    def begin_step(self) -> None: ...
    def end_backward(self) -> None: ...
    def finish(self) -> None: ...
    def owned_grads(self) -> list[torch.Tensor]: ...
    def before_optimizer_step(self) -> None: ...
    def after_step(self) -> None: ...
    def memory(self) -> dict[str, int]: ...

    params_sharded: bool
    """True when a forward all-gathers parameters (ZeRO-3): every rank must run every forward."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """The parameters this strategy holds in a form of its own, full, by name (collective);
        empty when the model's own tensors are the full parameters."""
        ...

    def load_model_state(self, state: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """Load what model_state() gives; returns the names it loaded."""
        ...


def split_batch(batch: Batch, micro_batch: int) -> list[Any]:
    """Cut every tensor of `batch` along dim 0 into pieces of `micro_batch` rows."""
    rows = _rows(batch)
    if rows % micro_batch:
        raise ValueError(f"this rank's batch has {rows} rows, not a multiple of micro_batch={micro_batch}")
    starts = range(0, rows, micro_batch)
    if isinstance(batch, torch.Tensor):
        return [batch[s: s + micro_batch] for s in starts]
    if isinstance(batch, Mapping):
        return [{k: v[s: s + micro_batch] for k, v in batch.items()} for s in starts]
    return [type(batch)(t[s: s + micro_batch] for t in batch) for s in starts]  # type: ignore[call-arg]


def _rows(batch: Batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    tensors = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must have the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


def to_device(batch: Batch, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return type(batch)(t.to(device, non_blocking=True) for t in batch)  # type: ignore[call-arg]


class Engine:
    """Built by paratrain.parallelize; owns the model, the gradient sync and the optimizer."""

    def __init__(self, model: nn.Module, ctx: Context, optimizer: torch.optim.Optimizer, grads: GradientStrategy,
                 *, micro_batch: int | None, precision: str, grad_clip: float,
                 optimizer_state: Callable[[], dict[str, Any]],
                 load_optimizer_state: Callable[[Mapping[str, Any]], None],
                 scaler: LossScaler | None = None, tp: TensorParallelLayout | None = None,
                 seed: int = 0, pipeline: PipelineExecutor | None = None, on_non_finite: str = "raise",
                 pieces: Pieces | None = None, experts: ExpertLayout | None = None,
                 buffers: BufferSync | None = None) -> None:
        if on_non_finite not in ("raise", "skip"):
            raise ValueError(f"on_non_finite must be 'raise' or 'skip', got {on_non_finite!r}")
        self.on_non_finite = on_non_finite
        """A step whose loss or gradient norm is nan or inf: 'raise' NonFiniteError, or 'skip' its update."""
        self.model = model
        self.ctx = ctx
        self.optimizer = optimizer
        self.grads = grads
        self.micro_batch = micro_batch
        self.precision = precision
        self.grad_clip = grad_clip
        self.last: StepStats | None = None
        """The statistics of the newest step read back (PendingStep.stats())."""
        self.watch = NonFiniteWatch(self)
        """Non-finite steps not yet read back (on_non_finite="raise")."""
        self._optimizer_state = optimizer_state
        self._load_optimizer_state = load_optimizer_state
        self._dp_group = ctx.mesh.groups.get("dp")
        self.scaler = scaler
        """fp16: the dynamic loss scale (None in fp32 and bf16)."""
        self.tp = tp
        """Tensor parallelism: which parameters are split (checkpoints hold them whole)."""
        self.pipeline = pipeline
        self.experts = experts
        """Expert parallelism: which expert weights this rank holds a slice of (checkpoints hold them whole)."""
        self.pieces = pieces if pieces is not None else Pieces(whole_shapes(model))
        """How this rank's tensors map to the whole model's (sharded checkpoints read and write by it)."""
        """Pipeline parallelism: runs the schedule over this rank's stage (None without pp)."""
        self._pp_group = ctx.mesh.groups.get("pp")
        self._agree = [g for g in (self._dp_group, ctx.mesh.groups.get("tp"), self._pp_group) if g is not None]
        """Axes over which an fp16 overflow decision must be shared."""
        self.dropout = DropoutStream(seed)
        """Keys every KeyedDropout of the model by (seed, step, module name, global position)."""
        for name, module in model.named_modules():
            if isinstance(module, KeyedDropout):
                module.attach(self.dropout, name)
        self.buffers = buffers
        """Under dp > 1: buffers that forward changes, kept equal over dp after each step (None: dp = 1)."""
        self.router_log = attach_router_log(model)
        """The MoE layers' auxiliary losses and routing counts of the step in progress (None: no MoE layer)."""

    def train_step(self, batch: Batch, loss_fn: LossFn) -> float:
        """Forward, backward and update on this rank's share of one global batch; returns its loss
        (read back from the device: see step() for a step that does not wait for it)."""
        return self.step(batch, loss_fn, wait=True).stats().loss

    def step(self, batch: Batch, loss_fn: LossFn, *, wait: bool = False) -> PendingStep:
        """As train_step, without reading anything back to the host: on a GPU the step is queued and
        this returns at once. Its loss, gradient norm and token count stay on the device until
        PendingStep.stats() reads them (read them once per log interval). Two policies must decide
        on the host before the update, so they read once per step: fp16 (was there an overflow) and
        on_non_finite="skip". Under "raise", a step whose loss or gradient norm is not finite is
        found by the next stats() or check() (collective), which raises NonFiniteError naming it:
        the updates in between are not undone, so read before saving a checkpoint.
        wait: read the values before the update (as train_step does): a non-finite step then raises
        or is skipped before it changes anything."""
        self.model.train()
        rows = _rows(batch)
        micro_batches = split_batch(batch, self.micro_batch or rows)
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
                self.dropout.row_offset = first_row + i * _rows(micro)
                loss_sum, count = self._forward(to_device(micro, self.ctx.device), loss_fn)
                scale = self._loss_scale(count) if self.scaler else 1.0
                if self.router_log is not None:  # the MoE layers' auxiliary terms get the loss sum's gradient
                    self.router_log.grad_scale = scale
                (loss_sum * scale if self.scaler else loss_sum).backward()
                self.grads.end_backward()
                totals[0] += loss_sum.detach().double()
                totals[1] += count
            if self.router_log is not None and self.router_log.aux_sum is not None:
                totals[0] += self.router_log.aux_sum  # the auxiliary losses belong to the step's loss
        self.grads.finish()
        local_loss = totals[0].clone()  # this rank's own, to name it if the step is not finite
        if self._dp_group is not None:
            all_reduce(totals, self._dp_group)
        if self.buffers is not None:
            self.buffers.end_step()
        self.dropout.step += 1
        pending = PendingStep(self, self.dropout.step, len(micro_batches), totals, local_loss)
        if self.router_log is not None:
            pending.routing = routing_totals(self.router_log, self.ctx.device, self._dp_group, self._pp_group)
        grads = self.grads.owned_grads()
        scale = self.scaler.scale if self.scaler and self.scaler.scale else 1.0
        if self.scaler is not None:
            pending.loss_scale = scale
            if self._overflow(grads):  # fp16 overflow somewhere: every rank skips and backs off the scale
                self.scaler.update(overflow=True)
                self.grads.after_step()
                pending.skipped = True
                return pending
        # The gradients are sums over the global batch (times the loss scale): their norm as means per
        # token is the sums' norm over the divisor; one pass below divides and clips (no tokens:
        # stats() says so).
        divisor = totals[1].clamp(min=1.0) * scale
        pending.grad_norm = global_grad_norm(self.grads.norm_parts()) / divisor
        if wait or self.on_non_finite == "skip":
            if pending.stats().non_finite:  # "raise" has raised; "skip": every rank skips alike
                self.grads.after_step()
                return pending
        else:
            self.watch.see(pending)
        divide_and_clip_(grads, divisor, pending.grad_norm, self.grad_clip)
        self.grads.before_optimizer_step()
        self.optimizer.step()
        self.grads.after_step()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return pending

    def check(self) -> None:
        """Raise NonFiniteError if a step since the last check had a loss or gradient norm that was not
        finite (on_non_finite="raise"; one read from the device; collective: call it on every rank)."""
        self.watch.check()

    def non_finite_ranks(self, local_loss: torch.Tensor) -> tuple[int, ...]:
        """The ranks whose own loss (before the sum over ranks) is nan or inf: a flag per rank of the
        world, combined over every axis (collective: every rank takes this path together). Gradients
        cannot name a rank: once reduced, one rank's nan is every rank's."""
        flags = torch.zeros(self.ctx.world_size, device=self.ctx.device)
        if not torch.isfinite(local_loss):
            flags[self.ctx.rank] = 1.0
        for group in self._agree:
            all_reduce(flags, group, op=dist.ReduceOp.MAX)
        return tuple(int(r) for r in torch.nonzero(flags).flatten().tolist())

    def _loss_scale(self, count: torch.Tensor | int) -> float:
        """The scale of this step; the very first one derives it from the micro-batch's token count,
        the smallest over dp (one all-reduce, once), so that every rank scales by the same factor."""
        assert self.scaler is not None
        if self.scaler.scale is None:
            first = torch.tensor([self.scaler.initial(float(count))], device=self.ctx.device)
            if self._dp_group is not None:
                all_reduce(first, self._dp_group, op=dist.ReduceOp.MIN)
            self.scaler.scale = float(first.item())
        return self.scaler.scale

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        """Whether any rank's gradients hold an inf or nan: an all-reduce (MAX) over dp and tp, so
        that every rank, whichever shard or slice it owns, takes the same decision."""
        flag = torch.zeros(1, device=self.ctx.device)
        for grad in grads:
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        for group in self._agree:
            all_reduce(flag, group, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @torch.no_grad()
    def eval_loss(self, batch: Batch, loss_fn: LossFn) -> float:
        """Mean per-token loss over the global batch (this rank's share given), without updating."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        micro_batches = split_batch(batch, self.micro_batch or _rows(batch))
        if self.pipeline is not None:
            totals += self._pipeline_pass(micro_batches, self.ctx.mesh.index("dp") * _rows(batch), train=False)
        else:
            for micro in micro_batches:
                loss_sum, count = self._forward(to_device(micro, self.ctx.device), loss_fn)
                totals[0] += loss_sum.double()
                totals[1] += count
        if self._dp_group is not None:
            all_reduce(totals, self._dp_group)
        self.model.train()
        return float(totals[0] / totals[1])

    def _pipeline_pass(self, micro_batches: list[Any], first_row: int, *, train: bool) -> torch.Tensor:
        """Run the pipeline schedule (or, not training, its forward program) over the micro-batches:
        (loss sum, token count), both as the loss function computed them on the last stage, summed over pp."""
        assert self.pipeline is not None
        pairs = []
        for micro in micro_batches:
            if not (isinstance(micro, (tuple, list)) and len(micro) == 2):
                raise TypeError("under pipeline parallelism a batch is (inputs, targets): the loss is computed "
                                "on the last stage from the targets")
            pairs.append(tuple(to_device(micro, self.ctx.device)))
        # The first scale of fp16 comes from the first micro-batch's size, before any rank has run the
        # loss: only the last stage ever knows the loss's own count, and every stage needs the scale.
        scale = self._loss_scale(pairs[0][1].numel()) if self.scaler and train else 1.0
        self.grads.begin_micro_batch(sync=False)  # the schedule interleaves micro-batches: reduce once, in finish()
        if self.router_log is not None:
            self.router_log.grad_scale = scale
        with contextlib.nullcontext() if train else torch.no_grad():
            totals = self.pipeline.run(pairs, dropout=self.dropout, first_row=first_row, loss_scale=scale,
                                       train=train, forward_context=lambda: autocast(self.precision, self.ctx.device))
        if train and self.router_log is not None and self.router_log.aux_sum is not None:
            totals[0] += self.router_log.aux_sum  # this stage's MoE layers' auxiliary losses
        assert self._pp_group is not None
        all_reduce(totals, self._pp_group)  # only the last stage computed them
        return totals

    def _forward(self, micro: Any, loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor | int]:
        with autocast(self.precision, self.ctx.device):
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
        optimizer = self._optimizer_state()
        if self.tp is not None:  # tensor-parallel slices -> whole tensors (collective over tp)
            model = self.tp.gather_full(model)
            optimizer = {**optimizer, "state": self._per_element_state(optimizer["state"], self.tp.full)}
        if self.experts is not None:  # this rank's experts -> every expert (collective over ep)
            model = self.experts.gather_full(model)
            optimizer = {**optimizer, "state": self._per_element_state(optimizer["state"], self.experts.full)}
        if self._pp_group is not None:  # every stage's part -> the whole model (collective over pp)
            model, optimizer = gather_stages(self.model, model, optimizer, self._pp_group)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "rng": {"dropout_step": self.dropout.step}}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        model, optimizer = state["model"], state["optimizer"]
        if self._pp_group is not None:  # the whole model -> this stage's part
            model, optimizer = stage_part(self.model, model, optimizer)
        if self.tp is not None:  # whole tensors -> this rank's slices
            model = self.tp.local_slices(model)
            optimizer = {**optimizer, "state": self._per_element_state(optimizer["state"], self.tp.local)}
        if self.experts is not None:  # every expert -> this rank's
            model = self.experts.local_slices(model)
            optimizer = {**optimizer, "state": self._per_element_state(optimizer["state"], self.experts.local)}
        loaded = self.grads.load_model_state(model)
        load_model_state(self.model, model, skip=loaded)
        self._load_optimizer_state(optimizer)
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
        self.dropout.step = int(state.get("rng", {}).get("dropout_step", 0))
        self.grads.begin_step()

    @staticmethod
    def _per_element_state(state: Mapping[str, Mapping[str, Any]],
                           convert: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, dict[str, Any]]:
        """Named optimizer state with every per-element tensor (shaped like its parameter: Adam's
        moments, not its step count) passed through convert(name, tensor), in name order."""
        return {name: {key: convert(name, value) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                       for key, value in sorted(state[name].items())}
                for name in sorted(state)}

    @property
    def flat_groups(self) -> list[FlatGroup]:
        """ZeRO's flat groups (empty under plain data parallelism)."""
        return list(getattr(self.grads, "groups", []))

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (steady state,
        between steps; transient buffers of a step in flight are not counted)."""
        report = self.grads.memory()
        masters = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        report["optimizer"] = sum(
            v.numel() * v.element_size()
            for p, st in self.optimizer.state.items() if id(p) in masters
            for v in st.values() if isinstance(v, torch.Tensor)
        ) + report.pop("masters", 0)
        return report
