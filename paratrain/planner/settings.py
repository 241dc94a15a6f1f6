"""StepSettings: the engine's settings besides the layout that a rank's bytes (model states, traffic) depend on, one
object for the planner's memory and traffic counts (paratrain.planner.memory, paratrain.planner.comm)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.memory import POLICIES
from paratrain.planner.layout import Layout

BYTES = {name: policy.compute.itemsize for name, policy in POLICIES.items()}
"""Bytes of one element stored in each precision (its policy's compute dtype: fp32 4, bf16 and fp16 2)."""


@dataclass(frozen=True)
class StepSettings:
    """The engine's settings besides the layout that a step's memory and traffic depend on."""

    precision: str = "fp32"
    bucket_mb: float = 25.0
    grad_reduce: str = "all_reduce"
    """ZeRO's reduction primitive: "all_reduce" (gloo's choice) or "reduce_scatter" (NCCL's)."""
    reshard_after_forward: bool = True
    """ZeRO-3: gather a block's parameters again for its backward."""
    pp_split: tuple[int, ...] = ()
    grad_dtype: str = "fp32"
    """ZeRO's gradient buffers beside 16-bit parameters (paratrain.EngineOptions.grad_dtype)."""
    grad_reduce_dtype: str | None = None
    """The dtype they are reduced in; None: grad_dtype's."""
    keep_grads: bool = False
    """The gradient buffers kept between steps (ParallelConfig.keep_grads)."""
    optimizer: str = "adamw"
    """adamw, muon (a momentum on its matrices, AdamW's state on the rest) or sgd (a momentum)."""
    muon_ns_dtype: str = "bf16"
    """Muon's Newton-Schulz dtype (OptimSection.muon_ns_dtype): what its exchange moves and holds."""
    state_dtype: str = "fp32"
    """The optimizer state's storage: fp32 or bf16 (OptimSection.state_dtype)."""
    fp8_recipe: str = "tensorwise"
    """Under precision fp8: the float8 recipe (ZeRO-3 gathers the float8 linears' weights in float8 under
    tensorwise)."""
    moe_imbalance: float = 1.0
    """Mixture-of-Experts under ep: the busiest ep rank's routed rows over a balanced share, a run's measured
    `expert_load_factor` (--log-json; `paratrain plan --moe-imbalance`). That rank receives, keeps and runs this many
    times the balanced rows; 1: balanced routing."""

    def float8_gathers(self, layout: Layout) -> bool:
        """Whether ZeRO-3 gathers the blocks' linear weights in float8 (paratrain.memory.Float8Settings.gathers_float8:
        precision fp8, the tensorwise recipe)."""
        return self.precision == "fp8" and self.fp8_recipe == "tensorwise" and layout.zero == 3

    def grad_bytes(self, layout: Layout) -> int:
        """Bytes of a gradient element in ZeRO's buffers (zero 0: float32)."""
        if not layout.zero or BYTES[self.precision] == 4:
            return 4
        return 4 if self.grad_dtype == "fp32" else BYTES[self.precision]

    def reduce_bytes(self, layout: Layout) -> int:
        """Bytes of a gradient element on the wire."""
        if self.grad_reduce_dtype is None or not layout.zero or BYTES[self.precision] == 4:
            return self.grad_bytes(layout)
        return 4 if self.grad_reduce_dtype == "fp32" else BYTES[self.precision]


PRICED = StepSettings(precision="bf16", grad_reduce="reduce_scatter")
"""What the planner prices unless told: bf16 with NCCL's reduce-scatter, AdamW."""
