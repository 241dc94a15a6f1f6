"""What parallelize hands the Engine: the gradient strategy it drives (a protocol GradSync, ZeroSync and the
parameter server's ServerClient implement), where the update happens (Update: paratrain.hybrid.update), the other
parts it built (EngineParts), and the choices it was given (EngineOptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from paratrain.comm import NormPart
from paratrain.comm.placement import Placements
from paratrain.context_parallel import SequenceShard
from paratrain.data_parallel import BATCH_NORM_MODES, BufferSync
from paratrain.nn.moe import RouterLog
from paratrain.hybrid.pieces import Pieces
from paratrain.hybrid.view import Replicas
from paratrain.memory import LossScaler, precision_policy
from paratrain.memory.float8_linears import Float8Settings
from paratrain.hybrid.step import NonFiniteWatch, PendingStep
from paratrain.pipeline.runtime import PipelineExecutor
from paratrain.sharding import WrapPolicy
from paratrain.rng import DropoutStream
from paratrain.state_layout import StateLayout
from paratrain.topology import AxisGroup, Context


class GradientStrategy(Protocol):
    """How a strategy reduces gradients (paratrain.data_parallel.GradSync, paratrain.sharding.ZeroSync).

    The engine calls, per step: begin_step(); per micro-batch: begin_micro_batch(sync=...), backward,
    end_backward();
    then finish() (gradients reduced), owned_grads() (divided by the token count, normed as
    norm_parts() say, clipped), before_optimizer_step(), the optimizer step, and after_step();
    close() once, at the end (Engine.close).
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

    def close(self) -> None:
        """Remove the hooks the strategy registered on the model (autograd keeps a parameter's hooks in tables the
        collector cannot see through, so hooks holding the strategy would keep it and its process groups, with
        their threads, alive for as long as the parameters live)."""
        ...

    params_sharded: bool
    """True when a forward all-gathers parameters (ZeRO-3): every rank must run every forward."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """The parameters this strategy holds in a form of its own, full, by name (collective);
        empty when the model's own tensors are the full parameters."""
        ...


class Update(Protocol):
    """Where a step's update happens once backward has run (paratrain.hybrid.update: LocalUpdate on this rank,
    ServedUpdate on the parameter servers), and what that place needs told around checkpoints and at the end."""

    def apply(self, engine: Stepping, totals: torch.Tensor, micro_batches: int, *, wait: bool) -> PendingStep:
        """Update from the step's reduced gradients and this rank's (loss sum, token count); Engine.step documents
        `wait`."""
        ...

    def before_save(self, step: int) -> None:
        """A checkpoint of `step` steps is being written."""
        ...

    def before_load(self) -> None:
        """A whole state dict is about to be loaded in memory (Engine.load_state_dict): refuse it if it cannot be."""
        ...

    def after_load(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """State of `step` steps was loaded into `optimizer` (and the model)."""
        ...

    def replicas(self) -> Replicas | None:
        """DiLoCo's replica groups, whose states a checkpoint keeps apart (None: one state)."""
        ...

    def close(self) -> None:
        """The run is over."""
        ...


@dataclass(frozen=True)
class EngineOptions:
    """How parallelize builds the engine and how a step runs: every choice that is not the model, its context, its
    optimizer, its recipe or where a meta model's values come from (paratrain.parallelize's other parameters).

        engine = paratrain.parallelize(model, ctx, optimizer=make_adamw,
                                       options=paratrain.EngineOptions(micro_batch=4, precision="bf16"))
    """

    micro_batch: int | None = None
    """Rows per forward/backward; None: this rank's whole share in one pass."""
    precision: str = "fp32"
    """'fp32'; 'bf16' / 'fp16': under zero 0, autocast with float32 weights and gradients; under zero >= 1,
    parameters and gradients stored in the low dtype, float32 masters in the sharded optimizer. fp16 adds dynamic
    loss scaling, starting at `loss_scale`. 'fp8': bf16, and the blocks' linears multiply in float8 (`fp8`)."""
    fp8: Float8Settings = Float8Settings()
    """Under precision 'fp8': the float8 recipe ('tensorwise' / 'rowwise'), which linears stay in bf16, the scaling
    (the logical tensors', or per shard to debug) and a ScaleLog (paratrain.memory.float8)."""
    grad_dtype: str = "fp32"
    """Under ZeRO with 16-bit parameters (precision bf16 / fp16): the dtype micro-batches accumulate gradients and
    shards are summed in, 'fp32' (Megatron's --accumulate-allreduce-grads-in-fp32) or the parameters' own ('bf16' /
    'fp16': half the bytes; DeepSpeed's default). Float32 parameters keep float32 gradients."""
    grad_reduce_dtype: str | None = None
    """The dtype a gradient buffer is reduced in ('bf16' under fp32 buffers halves the bytes on the wire);
    None: grad_dtype's."""
    loss_scale: float | None = None
    """fp16's first loss scale; None: 2^16 per token of the first micro-batch."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 0
    """Keys dropout masks (paratrain.nn.dropout); use the run's seed."""
    on_non_finite: str = "raise"
    """A step whose loss or gradient norm is nan or inf (outside fp16's own skip): 'raise'
    paratrain.hybrid.NonFiniteError on every rank, or 'skip' its update on every rank."""
    recompute: bool | str = False
    """'full' (or True) recomputes each of the recipe's blocks in backward, 'selective' each block's attention core
    (paratrain.memory.recompute); 'none' or False nothing; any other string is a regex of module names."""
    compile: bool | str = False
    """torch.compile each of the recipe's blocks (True: inductor; a string names another backend, e.g.
    'aot_eager'), after tensor parallelism and recomputation, as torchtitan does: each block's forward is compiled
    in place, so names, ZeRO-3's gathers and the pipeline see the same modules. Collectives and keyed dropout run
    eagerly between the compiled pieces."""
    sync_initial_weights: bool = True
    """Broadcast dp rank 0's weights, so replicas start equal even for a model whose init was not layout-free
    (cheap, once)."""
    wrap: WrapPolicy = None
    """ZeRO-3 units: a regex of module names or module class(es); None: the recipe's blocks (none: one unit, the
    whole model)."""
    reshard_after_forward: bool | None = None
    """ZeRO-3 frees a unit's full parameters after its forward and gathers them again for backward; False keeps
    them from forward to backward (more memory, less traffic). None: ctx.config.reshard_after_forward."""
    batch_norm: str = "sync"
    """Under dp > 1: 'sync' takes every BatchNorm's statistics over the forward's samples on every dp rank, as one
    process with dp x the micro-batch would (layout-free; needs one micro-batch per step, refused otherwise);
    'local' keeps each rank's own (DDP's default: the loss then depends on dp). paratrain.data_parallel.batch_norm."""
    buffers: Mapping[str, str] | None = None
    """Under dp > 1: buffer name or glob -> 'rank0' | 'sum' | 'mean': how a persistent buffer that forward changes
    is kept equal over the dp ranks after each step (default 'rank0', with a warning naming the buffer).
    paratrain.data_parallel.buffers."""

    def __post_init__(self) -> None:
        policy = precision_policy(self.precision)  # a name POLICIES holds
        for name, value in (("grad_dtype", self.grad_dtype), ("grad_reduce_dtype", self.grad_reduce_dtype)):
            if value is not None and value != "fp32" and precision_policy(value).compute != policy.compute:
                raise ValueError(f"{name} must be 'fp32' or the precision's own 16-bit dtype ({self.precision!r}), "
                                 f"got {value!r}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1 or None, got {self.micro_batch}")
        if self.on_non_finite not in ("raise", "skip"):
            raise ValueError(f"on_non_finite must be 'raise' or 'skip', got {self.on_non_finite!r}")
        if self.batch_norm not in BATCH_NORM_MODES:
            raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {self.batch_norm!r}")


class Stepping(Protocol):
    """What an Update reads of the engine whose step it finishes (paratrain.hybrid.engine.Engine)."""

    ctx: Context
    options: EngineOptions
    optimizer: torch.optim.Optimizer
    grads: GradientStrategy
    scaler: LossScaler | None
    buffers: BufferSync | None
    watch: NonFiniteWatch
    dropout: DropoutStream
    router_log: RouterLog | None
    dp_group: AxisGroup | None
    pp_group: AxisGroup | None
    routed_apart: AxisGroup | None
    agree: list[AxisGroup]


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
    update: Update
    """Where the update happens: on this rank (LocalUpdate), or on the parameter servers (ServedUpdate, whose
    client is `grads` too)."""
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
    hooks: tuple[RemovableHandle, ...] = ()
    """Gradient hooks parallelize registered outside the gradient strategy (sequence parallelism's sums over tp):
    Engine.close removes them."""
    routed: bool = False
    """The whole model has MoE layers (so every pipeline stage joins the routing statistics' collectives, with
    MoE layers of its own or not)."""
