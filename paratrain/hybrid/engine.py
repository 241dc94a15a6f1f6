"""Engine: one training step of a parallelized model, from this rank's share of the global batch.

    loss = engine.train_step(batch, loss_fn)

`batch` is this rank's share of the global batch (global_batch / dp samples); the engine cuts it
into micro-batches and accumulates. `loss_fn(model, micro_batch)` returns (sum of per-token losses,
number of tokens). The step's loss is sum / count over the *whole global batch*, and gradients are
divided by the same global count, so the loss and the update do not depend on dp, on the
micro-batch size or on how many tokens each micro-batch holds.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import NormPart, all_reduce, divide_and_clip_, global_grad_norm
from paratrain.hybrid.state import load_model_state, model_state
from paratrain.memory import LossScaler, autocast
from paratrain.models.dropout import KeyedDropout
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.pipeline.stages import gather_stages, stage_part
from paratrain.rng import DropoutStream
from paratrain.tensor_parallel import TensorParallelLayout
from paratrain.topology import Context

Batch = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor]]
LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Union[torch.Tensor, int]]]


class GradientStrategy(Protocol):
    """How a strategy reduces gradients (paratrain.data_parallel.GradSync, paratrain.sharding.ZeroSync).

    The engine calls, per step: begin_step(); per micro-batch: set `sync`, backward, end_backward();
    then finish() (gradients reduced), owned_grads() (divided by the token count, normed as
    norm_parts() say, clipped), before_optimizer_step(), the optimizer step, and after_step().
    """

    sync: bool
    """False: this micro-batch's backward only accumulates (the strategy may still communicate)."""

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


@dataclass(frozen=True)
class StepStats:
    loss: float
    """Mean loss per token over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    tokens: int
    """Tokens (loss terms) in the global batch."""
    micro_batches: int
    loss_scale: float | None = None
    """fp16: the loss scale this step used."""
    skipped: bool = False
    """No rank updated: fp16 gradients overflowed on some rank, or (on_non_finite="skip") the loss or
    the gradient norm was not finite."""
    non_finite: bool = False
    """Skipped because the loss or the gradient norm was nan or inf (on_non_finite="skip")."""
    non_finite_ranks: tuple[int, ...] = ()
    """Then: the ranks whose own loss was nan or inf (under pp: every stage of the pipeline that
    computed it); empty when only the gradients were."""


class NonFiniteError(FloatingPointError):
    """The global loss or gradient norm of a step is nan or inf (outside fp16's scaled skip). Raised on
    every rank alike: both values are the same on every rank."""

    def __init__(self, loss: float, grad_norm: float, ranks: tuple[int, ...], *, step: int) -> None:
        self.loss, self.grad_norm, self.ranks, self.step = loss, grad_norm, ranks, step
        where = (f"the loss of rank(s) {list(ranks)}' own samples was not finite" if ranks else
                 "every rank's own loss was finite: the gradients (or their sum over ranks) were not")
        super().__init__(f"the loss ({loss}) or gradient norm ({grad_norm}) of step {step} is not finite; {where}")


class PendingStep:
    """A step's statistics while they are still on the device (Engine.step). stats() reads them once
    (a host synchronisation) and caches the result; under on_non_finite="raise" it raises
    NonFiniteError for the first non-finite step since the engine last checked (collective)."""

    def __init__(self, engine: Engine, number: int, micro_batches: int, totals: torch.Tensor,
                 local_loss: torch.Tensor) -> None:
        self.engine, self.number, self.micro_batches = engine, number, micro_batches
        self.totals = totals
        """[loss sum, token count] over the global batch, float64."""
        self.local_loss = local_loss
        self.grad_norm: torch.Tensor | None = None
        self.loss_scale: float | None = None
        self.skipped = self.non_finite = False
        self._stats: StepStats | None = None

    @property
    def ready(self) -> bool:
        """Whether stats() has been read already (it costs nothing more then)."""
        return self._stats is not None

    @property
    def loss(self) -> torch.Tensor:
        """The mean loss per token, on the device (reading it is a host synchronisation)."""
        return self.totals[0] / self.totals[1]

    def stats(self, *, check: bool = True) -> StepStats:
        """Read the step's values (the first call waits for the device); also sets engine.last.
        check: raise NonFiniteError first if any step since the last check was not finite."""
        watched = self.engine._watch.take() if check else None
        if self._stats is None or watched is not None:  # one read from the device for both
            norm = self.grad_norm if self.grad_norm is not None else self.totals[0] * float("nan")
            parts = [torch.stack([self.totals[0], self.totals[1], norm.double()])]
            values = torch.cat(parts + ([watched] if watched is not None else [])).tolist()
            if watched is not None:
                self.engine._watch.judge(values[3:])
        if self._stats is None:
            loss_sum, tokens, norm_value = values[:3]
            if tokens <= 0:
                raise ValueError("the global batch holds no tokens to learn from (every target ignored)")
            loss, ranks = loss_sum / tokens, ()
            judged = self.grad_norm is not None  # not an fp16 overflow, skipped before any norm
            if judged and not (math.isfinite(loss) and math.isfinite(norm_value)):
                ranks = self.engine.non_finite_ranks(self.local_loss)  # collective; all ranks are here
                if self.engine.on_non_finite == "raise":
                    raise NonFiniteError(loss, norm_value, ranks, step=self.number)
                self.skipped = self.non_finite = True
            self._stats = StepStats(loss=loss, grad_norm=norm_value, tokens=int(tokens),
                                    micro_batches=self.micro_batches, loss_scale=self.loss_scale,
                                    skipped=self.skipped, non_finite=self.non_finite, non_finite_ranks=ranks)
        self.engine.last = self._stats
        return self._stats


class _NonFiniteWatch:
    """Under on_non_finite="raise", without a host read per step: the first step since the last check
    whose loss or gradient norm is not finite, kept on the device, read by check()."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.first: torch.Tensor | None = None
        """[step number (0: none), loss, grad norm, this rank's own loss], float64."""

    def see(self, step: PendingStep) -> None:
        assert step.grad_norm is not None
        loss, norm = step.loss, step.grad_norm.double()
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        record = torch.stack([torch.full_like(loss, float(step.number)), loss, norm, step.local_loss])
        if self.first is None:
            self.first = torch.zeros(4, dtype=torch.float64, device=loss.device)
        self.first = torch.where(bad & (self.first[0] == 0), record, self.first)

    def take(self) -> torch.Tensor | None:
        """The record so far (None: no step since the last take), forgotten here."""
        first, self.first = self.first, None
        return first

    def check(self) -> None:
        first = self.take()
        if first is not None:
            self.judge(first.tolist())

    def judge(self, record: list[float]) -> None:
        """Raise NonFiniteError if `record` (what take() gave, read) names a step."""
        number, loss, norm, local_loss = record
        if number:
            ranks = self.engine.non_finite_ranks(torch.tensor(local_loss))
            raise NonFiniteError(loss, norm, ranks, step=int(number))


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
                 seed: int = 0, pipeline: PipelineExecutor | None = None, on_non_finite: str = "raise") -> None:
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
        self._watch = _NonFiniteWatch(self)
        self._optimizer_state = optimizer_state
        self._load_optimizer_state = load_optimizer_state
        self._dp_group = ctx.mesh.groups.get("dp")
        self.scaler = scaler
        """fp16: the dynamic loss scale (None in fp32 and bf16)."""
        self.tp = tp
        """Tensor parallelism: which parameters are split (checkpoints hold them whole)."""
        self.pipeline = pipeline
        """Pipeline parallelism: runs the schedule over this rank's stage (None without pp)."""
        self._pp_group = ctx.mesh.groups.get("pp")
        self._agree = [g for g in (self._dp_group, ctx.mesh.groups.get("tp"), self._pp_group) if g is not None]
        """Axes over which an fp16 overflow decision must be shared."""
        self.dropout = DropoutStream(seed)
        """Keys every KeyedDropout of the model by (seed, step, module name, global position)."""
        for name, module in model.named_modules():
            if isinstance(module, KeyedDropout):
                module.attach(self.dropout, name)

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
        self.grads.begin_step()
        # Accumulate (loss sum, token count) in float64 so the reported loss is exact to print.
        totals = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        if self.pipeline is not None:
            totals += self._pipeline_pass(micro_batches, first_row, train=True)
        else:
            for i, micro in enumerate(micro_batches):
                self.grads.sync = i == len(micro_batches) - 1  # communicate on the last only
                self.dropout.row_offset = first_row + i * _rows(micro)
                loss_sum, count = self._forward(to_device(micro, self.ctx.device), loss_fn)
                (loss_sum * self._loss_scale(count) if self.scaler else loss_sum).backward()
                self.grads.end_backward()
                totals[0] += loss_sum.detach().double()
                totals[1] += count
        self.grads.finish()
        local_loss = totals[0].clone()  # this rank's own, to name it if the step is not finite
        if self._dp_group is not None:
            all_reduce(totals, self._dp_group)
        self.dropout.step += 1
        pending = PendingStep(self, self.dropout.step, len(micro_batches), totals, local_loss)
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
            self._watch.see(pending)
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
        self._watch.check()

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
        self.grads.sync = False  # the schedule interleaves micro-batches: reduce once, in finish()
        with contextlib.nullcontext() if train else torch.no_grad():
            totals = self.pipeline.run(pairs, dropout=self.dropout, first_row=first_row, loss_scale=scale,
                                       train=train, forward_context=lambda: autocast(self.precision, self.ctx.device))
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
