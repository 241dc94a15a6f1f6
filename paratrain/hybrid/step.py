"""What a training step returns: its statistics (StepStats), read back from the device only when
asked (PendingStep), and the watch that finds a non-finite step between reads (NonFiniteWatch)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from paratrain.comm import all_reduce
from paratrain.topology.mesh import AxisGroup
from paratrain.hybrid.experts import routing_stats

RankFinder = Callable[[torch.Tensor], "tuple[int, ...]"]
"""this rank's own loss -> the ranks whose own loss is not finite (collective: step.non_finite_ranks)."""


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
    moe: dict[str, float] | None = None
    """With MoE layers: their auxiliary losses per token, dropped fraction and assignments per expert
    (paratrain.hybrid.experts.routing_stats)."""
    staleness: dict[str, float] | None = None
    """Under the asynchronous parameter server: this trainer's step's staleness (clocks of updates its
    parameters missed) and over every push of the newest applied clock its most and mean."""


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

    def __init__(self, watch: NonFiniteWatch, number: int, micro_batches: int, totals: torch.Tensor,
                 local_loss: torch.Tensor) -> None:
        self.watch, self.number, self.micro_batches = watch, number, micro_batches
        self.totals = totals
        """[loss sum, token count] over the global batch, float64."""
        self.local_loss = local_loss
        self.grad_norm: torch.Tensor | None = None
        self.loss_scale: float | None = None
        self.skipped = self.non_finite = False
        self.routing: torch.Tensor | None = None
        """MoE layers: the step's routing totals over the job (paratrain.hybrid.experts)."""
        self.server: Any = None
        """Under the parameter server: its reply (paratrain.param_server.Reply: staleness in async mode)."""
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
        """Read the step's values (the first call waits for the device); the watch keeps them as its
        `last`. check: raise NonFiniteError first if any step since the last check was not finite."""
        watched = self.watch.take() if check else None
        if self._stats is None or watched is not None:  # one read from the device for both
            norm = self.grad_norm if self.grad_norm is not None else self.totals[0] * float("nan")
            parts = [torch.stack([self.totals[0], self.totals[1], norm.double()])]
            routed = 0 if self.routing is None else self.routing.numel()
            values = torch.cat(parts + ([self.routing] if self.routing is not None else [])
                               + ([watched] if watched is not None else [])).tolist()
            if watched is not None:
                self.watch.judge(values[3 + routed:])
        if self._stats is None:
            loss_sum, tokens, norm_value = values[:3]
            moe = routing_stats(values[3:3 + routed], tokens) if routed and tokens > 0 else None
            if tokens <= 0:
                raise ValueError("the global batch holds no tokens to learn from (every target ignored)")
            loss, ranks = loss_sum / tokens, ()
            judged = self.grad_norm is not None  # not an fp16 overflow, skipped before any norm
            if judged and not (math.isfinite(loss) and math.isfinite(norm_value)):
                ranks = self.watch.ranks(self.local_loss)  # collective; all ranks are here
                if self.watch.policy == "raise":
                    raise NonFiniteError(loss, norm_value, ranks, step=self.number)
                self.skipped = self.non_finite = True
            stale = None
            if self.server is not None and getattr(self.server, "asynchronous", False):
                stale = {"staleness": float(self.server.staleness), "staleness_max": self.server.stale_max,
                         "staleness_mean": self.server.stale_mean}
            self._stats = StepStats(loss=loss, grad_norm=norm_value, tokens=int(tokens),
                                    micro_batches=self.micro_batches, loss_scale=self.loss_scale,
                                    skipped=self.skipped, non_finite=self.non_finite, non_finite_ranks=ranks, moe=moe,
                                    staleness=stale)
        self.watch.last = self._stats
        return self._stats


class NonFiniteWatch:
    """Under on_non_finite="raise", without a host read per step: the first step since the last check
    whose loss or gradient norm is not finite, kept on the device, read by check(). Also where the
    newest statistics read back are kept (`last`)."""

    def __init__(self, policy: str, ranks: RankFinder) -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"on_non_finite must be 'raise' or 'skip', got {policy!r}")
        self.policy = policy
        """A step whose loss or gradient norm is nan or inf: 'raise' NonFiniteError, or 'skip' its update."""
        self.ranks = ranks
        self.last: StepStats | None = None
        """The statistics of the newest step read back (PendingStep.stats())."""
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
            ranks = self.ranks(torch.tensor(local_loss))
            raise NonFiniteError(loss, norm, ranks, step=int(number))


def non_finite_ranks(local_loss: torch.Tensor, *, rank: int, world_size: int, groups: list[AxisGroup]) -> tuple[int, ...]:
    """The ranks whose own loss (before the sum over ranks) is nan or inf: a flag per rank of the world,
    combined over `groups` (every axis: collective, every rank takes this path together). Gradients cannot
    name a rank: once reduced, one rank's nan is every rank's."""
    flags = torch.zeros(world_size, device=local_loss.device)
    if not torch.isfinite(local_loss):
        flags[rank] = 1.0
    for group in groups:
        all_reduce(flags, group, op=dist.ReduceOp.MAX)
    return tuple(int(r) for r in torch.nonzero(flags).flatten().tolist())
