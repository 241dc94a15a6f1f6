"""Bucketed gradient all-reduce, overlapped with backward.

Each parameter's .grad is a view into a flat bucket (paratrain.comm.buckets). A hook fires when a
parameter's gradient has been accumulated; when every parameter of a bucket has fired, the bucket's
all-reduce starts asynchronously, while backward goes on computing earlier layers' gradients.
Buckets are launched strictly in index order on every rank, so collectives always match up even if
autograd finishes buckets in a different order on different ranks. A bucket whose parameters got
no gradient in this backward (unused parameters) is launched at the end of backward with zeros.

Gradients are *summed* across ranks, not averaged: the engine divides by the token count of the
whole global batch afterwards, which is what makes the loss independent of the layout.

With accumulation, only the last micro-batch's backward communicates (`sync=False` before the
others), so a step of k micro-batches still costs one all-reduce per bucket.

The buckets exist while a step runs: allocated by begin_step, released by after_step (keep_grads:
zeroed and kept instead, for a user who wants no allocation per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm.buckets import Bucket, build_buckets
from paratrain.comm.collectives import Pending, all_reduce, all_reduce_async
from paratrain.comm.norms import NormPart
from paratrain.comm.hooks import WeakHook
from paratrain.comm.placement import Placements


@dataclass(frozen=True)
class SyncTimes:
    """When the last synced backward's communication happened (time.perf_counter seconds): its first
    bucket's all-reduce started, backward ended, every bucket was reduced. reduced - first_launch is
    the communication window, reduced - backward_end the part of it that backward did not hide."""

    first_launch: float = 0.0
    backward_end: float = 0.0
    reduced: float = 0.0


class GradSync:
    def __init__(self, params: list[nn.Parameter], placements: Placements, *, bucket_bytes: int,
                 keep_grads: bool = False) -> None:
        """placements: where each parameter's gradient is reduced and how it counts in the norm
        (paratrain.comm.placement); a bucket holds parameters of one placement. Nothing is ever sent
        when no parameter has a group to reduce over (a single process). keep_grads: keep the buckets
        between steps (zeroed) instead of releasing them."""
        self.placements = placements
        self.keep_grads = keep_grads
        self.buckets: list[Bucket] = build_buckets(params, cap_bytes=bucket_bytes, key=placements, allocate=keep_grads)
        self.communicates = any(k.reduce is not None or k.tied is not None for k in placements.kinds)
        self._sync = True
        """False: the backward in progress only accumulates (begin_micro_batch)."""
        self._bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        self._ready = [0] * len(self.buckets)
        self._pending: list[Pending] = []
        self._next = 0
        self._finish_queued = False
        self.launched_during_backward = 0
        """Buckets whose all-reduce started before backward ended, in the last synced backward."""
        self.times = SyncTimes()
        """The last synced backward's communication timeline (bench/bench_dp.py reads it)."""
        self._first_launch = self._backward_end = 0.0
        self._hooks = [p.register_post_accumulate_grad_hook(WeakHook(self._on_grad_ready))
                       for b in self.buckets for p in b.params] if self.communicates else []

    def owned_grads(self) -> list[torch.Tensor]:
        """The flat gradient buffers: every gradient of the model, each exactly once."""
        return [b.buffer for b in self.buckets]

    def norm_parts(self) -> list[NormPart]:
        """Every replica holds the whole reduced gradient; pieces split over other axes add up."""
        return self.placements.norm_parts(((b.params[0], b.buffer) for b in self.buckets), sharded=False)

    def begin_step(self) -> None:
        """Before the first micro-batch: the buckets allocated, .grad their views (again, if someone reset them)."""
        for bucket in self.buckets:
            bucket.allocate()
        self.launched_during_backward = 0

    def end_backward(self) -> None:
        """After each micro-batch's backward: nothing to do, accumulation stays in the buckets."""

    def before_optimizer_step(self) -> None:
        """The optimizer updates the parameters in place, with .grad the bucket views: nothing to do."""

    def after_step(self) -> None:
        if self.keep_grads:
            for bucket in self.buckets:
                bucket.buffer.zero_()
        else:
            for bucket in self.buckets:
                bucket.release()

    def close(self) -> None:
        """Remove the gradient hooks (GradientStrategy.close)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    params_sharded = False
    """Every rank holds the full parameters."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """Nothing of its own: the model's tensors are the full parameters."""
        return {}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, and for gradients while a step runs ("grads") and between
        steps ("grads_kept": the same with keep_grads, else 0)."""
        params = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
        grads = sum(b.nbytes for b in self.buckets)
        return {"params": params, "grads": grads, "grads_kept": grads if self.keep_grads else 0}

    def begin_micro_batch(self, *, sync: bool) -> None:
        """sync False: the coming backward only accumulates into the buckets; True: it reduces them."""
        self._sync = sync

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._finish_queued:
            # Runs once, when autograd has finished this whole backward pass.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self._next)
            self.launched_during_backward += 1

    def _launch(self, index: int) -> None:
        if self._next == 0:
            self._first_launch = time.perf_counter()
        bucket = self.buckets[index]
        group = self.placements(bucket.params[0]).reduce
        if group is not None:  # None: no other rank holds it (experts under ep = dp)
            self._pending.append(all_reduce_async(bucket.buffer, group))
        self._next += 1

    def _finish_backward(self) -> None:
        self._backward_end = time.perf_counter()
        while self._next < len(self.buckets):  # buckets holding parameters that got no gradient
            self._launch(self._next)

    def finish(self) -> None:
        """Block until every bucket of this step is reduced; then reset for the next step."""
        if self.communicates and self._next < len(self.buckets):
            # A synced backward that produced no gradient at all still has to meet its peers.
            self._finish_backward()
        for pending in self._pending:
            pending.wait()
        if self._pending:
            self.times = SyncTimes(self._first_launch, self._backward_end, time.perf_counter())
        self._pending.clear()
        for bucket in self.buckets:  # a weight tied across stages: sum its two ends' gradients
            tied = self.placements(bucket.params[0]).tied
            if tied is not None:
                all_reduce(bucket.buffer, tied)
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._finish_queued = False
