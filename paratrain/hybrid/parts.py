"""What parallelize hands the Engine: the gradient strategy it drives (a protocol GradSync and
ZeroSync implement), the other parts it built (EngineParts), and how a step runs (StepOptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from paratrain.comm import NormPart
from paratrain.comm.placement import Placements
from paratrain.context_parallel import SequenceShard
from paratrain.data_parallel import BufferSync
from paratrain.hybrid.pieces import Pieces
from paratrain.memory import PRECISIONS, LossScaler
from paratrain.param_server import ServerClient
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.state_layout import StateLayout


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


@dataclass(frozen=True)
class StepOptions:
    """How the engine runs a step (paratrain.parallelize documents each)."""

    micro_batch: int | None = None
    """Rows per forward/backward; None: this rank's whole share in one pass."""
    precision: str = "fp32"
    grad_clip: float = 0.0
    seed: int = 0
    """Keys dropout masks (paratrain.nn.dropout)."""
    on_non_finite: str = "raise"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1 or None, got {self.micro_batch}")
        if self.on_non_finite not in ("raise", "skip"):
            raise ValueError(f"on_non_finite must be 'raise' or 'skip', got {self.on_non_finite!r}")


@dataclass(frozen=True)
class EngineParts:
    """What parallelize built for the engine to drive."""

    optimizer: torch.optim.Optimizer
    grads: GradientStrategy
    optimizer_state: Callable[[], dict[str, Any]]
    """The optimizer's state by parameter name, as this rank holds it."""
    pieces: Pieces
    """How this rank's tensors map to the whole model's."""
    placements: Placements
    """Where each parameter's gradient is reduced, sharded and counted (and which rank saves it)."""
    layouts: tuple[StateLayout, ...] = ()
    """What each strategy that splits the state changed (tensor, expert, pipeline), in the order applied."""
    pipeline: PipelineExecutor | None = None
    """Runs the schedule over this rank's stage (None without pp)."""
    scaler: LossScaler | None = None
    """fp16: the dynamic loss scale (None in fp32 and bf16)."""
    buffers: BufferSync | None = None
    """Under dp > 1: buffers that forward changes, kept equal over dp after each step (None: dp = 1)."""
    sequence: SequenceShard | None = None
    """Under cp > 1: this rank's part of each sequence; the engine cuts every micro-batch to it."""
    remote: ServerClient | None = None
    """Under the parameter server: the update happens on the servers (push, then pull); `grads` is it too."""
    routed: bool = False
    """The whole model has MoE layers (so every pipeline stage joins the routing statistics' collectives, with
    MoE layers of its own or not)."""
