"""Data parallelism: full replicas, bucketed gradient all-reduce overlapped with backward."""

from paratrain.data_parallel.grad_sync import GradSync

__all__ = ["GradSync"]
