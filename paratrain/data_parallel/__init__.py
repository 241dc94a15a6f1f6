"""Data parallelism: full replicas, bucketed gradient all-reduce overlapped with backward."""

from paratrain.data_parallel.grad_sync import GradSync, SyncTimes

__all__ = ["GradSync", "SyncTimes"]
