"""Precision policies (Precision, one per name in POLICIES) and dynamic loss scaling.

    fp32   everything in float32.
    bf16   compute in bfloat16. Plain DP (zero 0): torch.autocast, weights and gradients float32.
           ZeRO (zero >= 1): parameters and gradients stored in bfloat16, float32 master weights
           held, sharded, by the optimizer (the ZeRO paper's mixed-precision accounting: 2 + 2
           bytes per parameter on every rank, 12 in the optimizer's shard).
    fp16   as bf16 with float16, plus dynamic loss scaling: float16's narrow range would turn small
           gradients into zeros, so the loss is multiplied by a scale before backward and the
           gradients divided by it after; a step whose gradients overflow is skipped.
    fp8    as bf16, and the blocks' linears multiply in float8 with scales of the logical tensors
           (paratrain.memory.float8, docs/precision.md).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.distributed as dist

from paratrain.comm import all_reduce
from paratrain.topology.mesh import AxisGroup
from paratrain.topology.quorum import Quorum

@dataclass(frozen=True)
class Precision:
    """One precision policy: every dtype decision a run makes, read where a decision is made (the engine's forward,
    ZeRO's flat storage, the pipeline's boundaries, loss scaling, the planner's byte counts), so a new format is one
    policy and its casts.

    The casts themselves stay torch's: autocast runs the matmuls in `compute`; under ZeRO the flat groups store
    parameters and gradients in `stored` with float32 masters in the optimizer's shard."""

    name: str
    compute: torch.dtype
    """The matmuls' dtype (torch.autocast; float32: no autocast)."""
    stored: torch.dtype | None
    """Under ZeRO (zero >= 1): the dtype parameters and gradients are stored, reduced and gathered in, float32
    masters beside them; None: the parameters' own (float32). Plain data parallelism keeps float32 weights and
    gradients and reduces in float32 whatever the policy (autocast only)."""
    loss_scaling: bool = False
    """Dynamic loss scaling (LossScaler): float16's narrow range would turn small gradients into zeros."""
    float8: bool = False
    """The blocks' linears multiply in float8 (paratrain.memory.float8.apply_float8); the rest as `compute`."""

    @property
    def low(self) -> bool:
        """Compute in a 16-bit dtype."""
        return self.compute != torch.float32

    def autocast(self, device: torch.device) -> ContextManager[object]:
        """The forward's region: matmuls in `compute` under torch.autocast (CPU and CUDA); nothing in float32, nor
        on the meta device (a dry run: shapes only, which autocast does not serve)."""
        if not self.low or device.type == "meta":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)

    def casts_once(self, device: torch.device) -> ContextManager[object]:
        """Around a pipeline step: every forward's autocast reuses one 16-bit copy of each weight, so a stage keeps
        one copy whatever its micro-batches in flight (without it each forward casts anew, and each micro-batch's
        graph keeps its own copy until its backward: p copies on the first stage of 1F1B).

        torch.autocast caches the casts of weights (leaf tensors that require grad) until the outermost autocast
        region exits; this is that outer region, itself disabled (the backward actions between the forwards run
        outside autocast, as before). The weights do not change inside a step, so the cache never goes stale."""
        if not self.low or device.type == "meta":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, enabled=False)

    def stored_dtype(self, *, sharded: bool) -> torch.dtype:
        """The dtype of the parameters a rank holds: `stored` under ZeRO, float32 otherwise."""
        return self.stored if sharded and self.stored is not None else torch.float32

    def scaler(self, first_scale: float | None, across: Quorum | None = None) -> LossScaler | None:
        """The dynamic loss scale this policy needs (None without loss scaling), starting at `first_scale` (None:
        from the first micro-batch's tokens, the smallest over the dp ranks and the replica groups `across`)."""
        return LossScaler(scale=first_scale, across=across) if self.loss_scaling else None


POLICIES: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, None),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16),
    "fp16": Precision("fp16", torch.float16, torch.float16, loss_scaling=True),
    "fp8": Precision("fp8", torch.bfloat16, torch.bfloat16, float8=True),
}
"""The precision policies by the name a config, a flag or EngineOptions gives."""
PRECISIONS = tuple(POLICIES)


def precision_policy(name: str) -> Precision:
    """The policy named `name`, or a ValueError naming the ones there are."""
    if name not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return POLICIES[name]


@dataclass
class LossScaler:
    """Dynamic loss scale (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2).

    After an overflow (an inf or nan in any rank's gradients: the caller makes every rank agree) the
    scale is multiplied by `backoff` and the step is skipped; after `growth_interval` steps in a
    row without one, it is multiplied by `growth`.
    """

    scale: float | None = None
    """None: set at the first micro-batch to per_token / its token count (rounded down to a power of
    two), because the engine scales a *sum* of per-token losses, not a mean."""
    per_token: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0
    across: Quorum | None = None
    """Replica groups whose gradient sums meet every step (fault_tolerance 'replica'; not DiLoCo's, which meet at
    outer steps only): the first scale is the smallest over them too, or each group's scaled gradients would be
    summed with another's scale. A group joining later is sent the scale with the rest of the state."""

    def initial(self, tokens: float) -> float:
        """The first scale for a micro-batch of `tokens` loss terms (a power of two, at least min_scale)."""
        return max(self.min_scale, 2.0 ** math.floor(math.log2(self.per_token / max(tokens, 1.0))))

    def agreed(self, tokens: float, device: torch.device, group: AxisGroup | None) -> float:
        """This step's scale. The very first derives it from the micro-batch's token count, the smallest
        over `group` (the dp ranks: one all-reduce, once) and the replica groups `across` (one reduce over their
        quorum, which may raise ReplicaLost before anything is applied), so that every rank scales by the same
        factor."""
        if self.scale is None:
            first = torch.tensor([self.initial(tokens)], device=device)
            if group is not None:
                all_reduce(first, group, op=dist.ReduceOp.MIN)
            if self.across is not None:
                self.across.reduce([first], op=dist.ReduceOp.MIN)
            self.scale = float(first.item())
        return self.scale

    def update(self, overflow: bool) -> None:
        assert self.scale is not None
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth

    def state_dict(self) -> dict[str, float | None]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.scale = None if state["scale"] is None else float(state["scale"])
        self.good_steps = int(state["good_steps"] or 0)


def overflowed(grads: list[torch.Tensor], device: torch.device, groups: list[AxisGroup]) -> bool:
    """Whether any rank's gradients hold an inf or nan: an all-reduce (MAX) over `groups` (dp, tp and pp),
    so that every rank, whichever shard or slice it owns, takes the same decision."""
    flag = torch.zeros(1, device=device)
    for grad in grads:
        if not torch.isfinite(grad).all():
            flag.fill_(1.0)
            break
    for group in groups:
        all_reduce(flag, group, op=dist.ReduceOp.MAX)
    return bool(flag.item())
