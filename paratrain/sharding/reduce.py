"""GradReducer: ZeRO's gradients, from the parameters' hooks to this rank's summed shards.

Gradients are summed over dp flat group by flat group from post-accumulate-grad hooks, in group
order (the order gradients complete in backward), and this rank keeps the sum for its shard only.
Every buffer lives while a step runs, from begin_step to after_step (ZeroOptions.keep_grads: kept,
zeroed, between steps too). How long the full-size buffers live within a step and which backwards
communicate is the stage's rule
(ZeroOptions.persistent_grads, ZeroOptions.reduce_every_micro_batch):

    stage 1             .grad are views of persistent flat buffers; the step's last backward
                        launches, finish() completes
    stages 2-3          each gradient is added into its group's buffer and freed; a complete buffer
                        is launched at once and dropped; end_backward() completes every micro-batch
    deferred (pp)       as stage 2, but only the step's last backward launches; finish() completes

Per flat buffer, the reduction primitive is ZeroOptions.reduce_op over the group's Placement:
reduce-scatter in the shard group (then, MiCS, an all-reduce of the shard across the replicas), or
one all-reduce over dp keeping the shard's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.comm import Pending, all_reduce, all_reduce_async, reduce_scatter_async
from paratrain.comm.placement import Placement
from paratrain.comm.flat import FlatGroup
from paratrain.comm.hooks import WeakHook
from paratrain.sharding.gather import ParamGatherer
from paratrain.sharding.options import ZeroOptions


@dataclass
class _InFlight:
    group: FlatGroup
    flat: torch.Tensor
    """The full gradient buffer being reduced (kept alive until the reduction is done)."""
    shard: torch.Tensor | None
    """reduce_scatter: where the shard's sum lands; all_reduce: None (slice `flat`)."""
    pending: Pending | None


class GradReducer:
    def __init__(self, params: list[nn.Parameter], groups: list[FlatGroup], placements: list[Placement],
                 options: ZeroOptions, gatherer: ParamGatherer | None) -> None:
        """groups: the flat groups in the order their gradients complete; placements: each group's
        Placement, by index; gatherer (ZeRO-3): told when a group's reduction is launched, so that a
        unit whose gradients are all in can free its full parameters."""
        self.groups = groups
        self.placements = placements
        self.options = options
        self.gatherer = gatherer
        self._group_of = {id(p): g for g in groups for p in g.params}
        self._position = {id(p): i for g in groups for i, p in enumerate(g.params)}
        # Gradient buffers exist while a step runs (begin_step to after_step; all steps with keep_grads): on a
        # CPU their pages then cost nothing until training starts (building a large model holds only its shards).
        self.grad_flats: list[torch.Tensor | None] = [None] * len(groups)
        """Full-size gradient buffers by group index: persistent (stage 1), or the one filling now."""
        self.grad_shards: list[torch.Tensor] = []
        """This rank's summed gradient shard of each group: what the optimizer's masters see (empty
        between steps unless keep_grads)."""
        self.keep_grads = options.keep_grads
        self._sync = True
        """False: the backward in progress only accumulates (begin_micro_batch)."""
        self._ready = [0] * len(groups)
        self._next = 0
        self._finish_queued = False
        self._in_flight: list[_InFlight] = []
        self._hooks = [p.register_post_accumulate_grad_hook(WeakHook(self._on_grad_ready)) for p in params]

    # ---- backward -------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The step's gradient buffers, zeroed (kept ones already are), and the .grad that view them."""
        if not self.grad_shards:
            for g in self.groups:
                flat = None
                if self.options.persistent_grads:
                    flat = self.grad_flats[g.index] = self._zeros(g, g.padded)
                self.grad_shards.append(g.shard_of(flat) if flat is not None and self.options.shard_in_grad_buffer
                                        else self._zeros(g, g.shard_numel))
        if self.options.persistent_grads:
            for g in self.groups:
                flat = self.grad_flats[g.index]
                assert flat is not None
                if not self.options.grads_viewed(g.param_flat.dtype):
                    continue
                for param, view in zip(g.params, g.views(flat)):
                    if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                        param.grad = view
        for g, shard in zip(self.groups, self.grad_shards):
            if not g.own_master:
                g.master.grad = shard

    def _zeros(self, group: FlatGroup, numel: int) -> torch.Tensor:
        """A gradient buffer: in the options' grad_dtype, else the stored parameters'."""
        return torch.zeros(numel, dtype=self.options.grad_dtype or group.param_flat.dtype,
                           device=group.param_flat.device)

    def begin_micro_batch(self, *, sync: bool) -> None:
        self._sync = sync

    def _communicates(self) -> bool:
        return self.options.reduce_every_micro_batch or self._sync

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        group = self._group_of[id(param)]
        if not self.options.grads_viewed(group.param_flat.dtype):
            # Move the gradient into its group's buffer (converted to its dtype) and free the parameter-sized one.
            flat = self.grad_flats[group.index]
            if flat is None:
                flat = self.grad_flats[group.index] = self._zeros(group, group.padded)
            offset = group.offsets[self._position[id(param)]]
            assert param.grad is not None
            flat[offset: offset + param.numel()].view_as(param).add_(param.grad)
            param.grad = None
        if not self._communicates():
            return
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._launch_rest)
            self._finish_queued = True
        self._ready[group.index] += 1
        while self._next < len(self.groups) and self._ready[self._next] == len(self.groups[self._next].params):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        group = self.groups[index]
        flat = self.grad_flats[index]
        if flat is None:  # no parameter of this group got a gradient in this backward
            flat = self._zeros(group, group.padded)
        if not self.options.persistent_grads:
            self.grad_flats[index] = None  # the next micro-batch starts a fresh buffer
        shard = pending = None
        placement = self.placements[index]
        reduce_dtype = self.options.reduce_dtype
        if reduce_dtype is not None and reduce_dtype != flat.dtype:  # reduced in a copy of its own dtype
            flat = flat.to(reduce_dtype)
        if self.options.reduce_op == "all_reduce":
            if placement.reduce is not None:
                pending = all_reduce_async(flat, placement.reduce)
        elif placement.shard is not None:
            shard = torch.empty(group.shard_numel, dtype=flat.dtype, device=flat.device)
            pending = reduce_scatter_async(shard, flat, placement.shard)
        elif placement.reduce is not None:  # shard group of 1 (S = 1): plain all-reduce of the shard
            pending = all_reduce_async(flat, placement.reduce)
        self._in_flight.append(_InFlight(group, flat, shard, pending))
        self._next += 1
        if self.gatherer is not None:  # every gradient of the unit may be in: its parameters can go
            self.gatherer.reduced(index)

    def _launch_rest(self) -> None:
        while self._next < len(self.groups):
            self._launch(self._next)

    def _complete(self) -> None:
        """Wait for every reduction in flight and add its sum into this rank's gradient shards."""
        for item in self._in_flight:
            if item.pending is not None:
                item.pending.wait()
            if item.shard is not None:
                replicate = self.placements[item.group.index].replicate
                if replicate is not None:  # MiCS: the shard's sum over the other replicas
                    all_reduce(item.shard, replicate)
                summed = item.shard
            else:
                summed = item.group.shard_of(item.flat)
            target = self.grad_shards[item.group.index]
            if summed.data_ptr() == target.data_ptr():
                continue
            if self.options.shard_in_grad_buffer:  # the shard is the buffer's own slice, reduced in a copy
                target.copy_(summed)
            else:
                target.add_(summed)
        self._in_flight.clear()
        self._ready = [0] * len(self.groups)
        self._next = 0
        self._finish_queued = False

    def end_backward(self) -> None:
        if self.options.reduce_every_micro_batch:  # every micro-batch was reduced: fold it into the shards now
            if self._next < len(self.groups):
                self._launch_rest()
            self._complete()

    def finish(self) -> None:
        if not self.options.reduce_every_micro_batch:
            if self._next < len(self.groups):  # a synced backward that produced no gradient at all
                self._launch_rest()
            self._complete()
        # (stages 2-3 otherwise: end_backward already reduced every micro-batch)
        for g in self.groups:  # a weight tied across stages: sum its two ends' shards
            tied = self.placements[g.index].tied
            if tied is not None:
                all_reduce(self.grad_shards[g.index], tied)

    # ---- after the optimizer step -------------------------------------------------------------
    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def after_step(self) -> None:
        """The update is done: zero the gradient buffers (keep_grads), or release them and every .grad
        that views them."""
        if self.keep_grads:
            kept = [*self.grad_shards, *(f for f in self.grad_flats if f is not None)]
            if kept:  # (none before the first step: a checkpoint loaded first)
                torch._foreach_zero_(kept)
            return
        self.grad_shards = []
        self.grad_flats = [None] * len(self.groups)
        for g in self.groups:
            g.master.grad = None
            for param in g.params:
                param.grad = None

    def memory(self) -> dict[str, int]:
        """Bytes of gradients a step holds ("grads": full buffers under stage 1 and under a pipeline's deferred
        stage 2, which accumulates every micro-batch in them; else shards only; the buffer being reduced
        aside) and how many of them stay between steps ("grads_kept": the full buffers of stage 1 and the
        shards, with keep_grads)."""
        grads = kept = 0
        for g in self.groups:
            size = (self.options.grad_dtype or g.param_flat.dtype).itemsize
            full = size * g.padded if self.options.persistent_grads or self.options.deferred else 0
            shard = 0 if self.options.shard_in_grad_buffer else size * g.shard_numel
            grads += full + shard
            kept += (full if self.options.persistent_grads else 0) + shard
        return {"grads": grads, "grads_kept": kept if self.keep_grads else 0}
