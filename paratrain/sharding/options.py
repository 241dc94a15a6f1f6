"""ZeroOptions: what a ZeroSync is asked to do, checked once, and the rules each stage follows.

The stage decides three things, answered here once instead of at every branch of the strategy:
- whether full gradient buffers persist across micro-batches (stage 1) or each parameter's gradient
  moves into a buffer that is reduced and freed as soon as its group is complete (stages 2-3);
- whether every micro-batch's backward communicates (stages 2-3, unless a pipeline defers the
  reduction to finish()) or only the step's last (stage 1);
- whether parameters are sharded too (stage 3: gathered around their modules) or kept whole
  (stages 1-2: all-gathered after each optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from paratrain.topology import AxisGroup

REDUCE_OPS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class ZeroOptions:
    stage: int                       # 1, 2 or 3
    """P_os (1), P_os+g (2) or P_os+g+p (3): what is split over the shard group besides the optimizer state."""
    bucket_bytes: int
    """Stages 1-2: the size cap of a flat group (stage 3 groups follow units instead)."""
    reduce_op: str                   # 'reduce_scatter' | 'all_reduce'
    """How a flat gradient buffer is summed: reduce-scatter in the shard group (half the bytes under
    NCCL), or an all-reduce over dp keeping the shard's slice (faster with gloo)."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit's full parameters after its forward (False: keep them until its backward)."""
    offload: bool = False            # optimizer state and masters in CPU memory
    """ZeRO-Offload (Ren et al. 2021): the optimizer's masters and state live in CPU memory and the
    update runs there; the device keeps only its working copy of the shard."""
    param_dtype: torch.dtype | None = None
    """Store parameters and gradients in this dtype (bf16 / fp16); the optimizer's masters stay in the
    parameters' original dtype (float32). None: the parameters' own."""
    grad_dtype: torch.dtype | None = None
    """The gradient buffers' dtype: micro-batches accumulate and shards are summed in it (float32 beside 16-bit
    parameters: Megatron's --accumulate-allreduce-grads-in-fp32); None: the stored parameters'."""
    reduce_dtype: torch.dtype | None = None
    """The dtype a buffer is reduced in (a 16-bit copy of float32 buffers halves the bytes; torchtitan's
    mixed_precision_reduce); None: grad_dtype's."""
    keep_grads: bool = False
    """Keep the gradient buffers between steps, zeroed (no allocation per step); False: released after
    each update, as torch's zero_grad(set_to_none=True)."""
    float8_gather: Mapping[int, AxisGroup | None] = field(default_factory=dict)
    """Stage 3: the parameters (by id) gathered in float8, each cast by its whole tensor's power-of-two scale, with
    the group that splits the tensor besides the shard group (tp), if any: the weights of tensorwise float8
    linears, which cast them so themselves (paratrain.sharding.float8_gather)."""
    deferred: bool = False           # pipeline: gradients reduced once in finish()
    """Reduce once per step, after the last backward (pipeline schedules interleave the micro-batches'
    backwards); stage 2 then keeps full gradients during the step and only the shards between steps."""

    def __post_init__(self) -> None:
        if self.deferred and self.stage == 3:
            raise ValueError("ZeRO-3 gathers parameters around each module's forward and backward, which a "
                             "pipeline schedule interleaves across micro-batches: use zero 1 or 2 with pp")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroSync implements stages 1, 2 and 3, got {self.stage}")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op must be 'all_reduce' or 'reduce_scatter', got {self.reduce_op!r}")

    @property
    def persistent_grads(self) -> bool:
        """Stage 1: full gradients accumulate in persistent flat buffers (the parameters' .grad view them, as
        in plain DP, when they share the parameters' dtype). Stages 2-3: a gradient moves into its group's
        buffer when ready."""
        return self.stage == 1

    def grads_viewed(self, param_dtype: torch.dtype) -> bool:
        """The parameters' .grad are views of the buffers (stage 1, buffers in the parameters' dtype); else
        each gradient is added into its buffer when ready and freed."""
        return self.persistent_grads and (self.grad_dtype is None or self.grad_dtype == param_dtype)

    @property
    def reduce_every_micro_batch(self) -> bool:
        """Stages 2-3 (not deferred): every backward reduces its buffers and folds them into the
        shards at its end. Otherwise only the step's last backward communicates, completed in finish()."""
        return self.stage >= 2 and not self.deferred

    @property
    def params_sharded(self) -> bool:
        """Stage 3: parameters are sharded too, gathered just before use and freed after."""
        return self.stage == 3

    @property
    def shard_in_grad_buffer(self) -> bool:
        """Stage 1 with all-reduce: the gradient shard is the slice of the persistent buffer itself."""
        return self.persistent_grads and self.reduce_op == "all_reduce"
