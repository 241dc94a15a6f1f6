"""Data parallelism: full replicas, bucketed gradient all-reduce overlapped with backward; batch
statistics and buffers kept layout-free."""

from paratrain.data_parallel.batch_norm import (BATCH_NORM_MODES, SyncedBatchNorm, apply_synced_batch_norm, batch_norms,
                                               check_accumulation)
from paratrain.data_parallel.buffers import BUFFER_RULES, BufferSync, buffer_rules
from paratrain.data_parallel.diloco import OuterSettings, OuterStep, optimizer_tensors
from paratrain.data_parallel.grad_sync import GradSync, SyncTimes

__all__ = ["BATCH_NORM_MODES", "BUFFER_RULES", "BufferSync", "GradSync", "OuterSettings", "OuterStep", "SyncTimes", "SyncedBatchNorm",
           "apply_synced_batch_norm", "batch_norms", "buffer_rules", "check_accumulation",
           "optimizer_tensors"]
