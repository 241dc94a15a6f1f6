"""Communication on explicit groups: named collectives, gradient buckets, global norms."""

from paratrain.comm.buckets import Bucket, build_buckets, plan_buckets
from paratrain.comm.collectives import (
    CollectiveError,
    Pending,
    all_gather_async,
    all_to_all,
    all_to_all_async,
    all_reduce,
    all_reduce_async,
    broadcast,
    reduce_scatter_async,
)
from paratrain.comm.norms import NormPart, divide_and_clip_, global_grad_norm
from paratrain.comm.volume import CollectiveCounter, CommVolume

__all__ = [
    "Bucket", "CollectiveCounter", "CommVolume", "CollectiveError", "Pending", "all_gather_async", "all_to_all", "all_to_all_async", "all_reduce", "all_reduce_async", "broadcast",
    "reduce_scatter_async",
    "NormPart", "build_buckets", "divide_and_clip_", "plan_buckets", "global_grad_norm",
]
