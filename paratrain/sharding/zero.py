"""ZeRO-1 and ZeRO-2 over the dp axis, with hierarchical shard groups (Rajbhandari et al. 2020).

One model of sharding, parameterised by the stage:
- every trainable parameter lives in a FlatGroup (size-capped buckets, one optimizer group each),
  whose flat buffer is split evenly across the shard group;
- the optimizer is re-pointed at this rank's shard (`FlatGroup.master`), so its state (Adam's two
  moments: 8 bytes per parameter in fp32) exists for 1/S of the parameters (P_os);
- gradients are summed over dp bucket by bucket from post-accumulate-grad hooks, in bucket order,
  and this rank keeps the sum for its shard only;
- after the optimizer step, each shard group all-gathers the updated shards into full parameters.

stage 1: full gradients accumulate in persistent flat buffers (the parameters' .grad are views, as
    in plain DP); only the last micro-batch communicates.
stage 2: a parameter's gradient is copied into its group's buffer as soon as it is ready and freed;
    the buffer is reduced and freed as soon as the group is complete, every micro-batch, the sum
    kept in this rank's shard: full-size gradients never outlive their bucket (P_os+g).
stage 3: as stage 2, and parameters are sharded too (P_os+g+p): flat groups follow units (wrapped
    modules, see gather.py), whose full parameters are gathered just before use and freed after.

Each flat group reduces, shards and counts in the norm over the groups of its parameters' Placement
(paratrain.comm.placement): dp, dp_shard and dp_replicate for most; edp for experts under expert
parallelism (the ranks holding the same experts).

Hierarchical sharding (MiCS, Zhang et al. 2022; torch's HSDP): with a shard group of S < dp ranks,
a shard's gradient is summed over all dp ranks (reduce-scatter in the shard group, then all-reduce
of the shard across the dp / S replicas; or one all-reduce over dp), and the all-gather of
parameters stays inside the shard group.

The reduction primitive is a choice: reduce-scatter moves half the bytes of an all-reduce (NCCL),
but gloo's reduce-scatter is slower than its all-reduce, so on CPU the default all-reduces the flat
buffer over dp and keeps the shard's slice.

Requires an element-wise optimizer (SGD, Adam, AdamW, ...): the update of an element must depend
only on that element's state, since flat shards cut through parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from paratrain.comm import (
    NormPart,
    Pending,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    plan_buckets,
    reduce_scatter_async,
)
from paratrain.comm.placement import Placement, Placements
from paratrain.sharding.flat import FlatGroup
from paratrain.sharding.gather import ParamGatherer, WrapPolicy, units_of


@dataclass
class _InFlight:
    group: FlatGroup
    flat: torch.Tensor
    """The full gradient buffer being reduced (kept alive until the reduction is done)."""
    shard: torch.Tensor | None
    """reduce_scatter: where the shard's sum lands; all_reduce: None (slice `flat`)."""
    pending: Pending | None


class ZeroSync:
    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, names: dict[int, str],
                 *, stage: int, bucket_bytes: int, reduce_op: str, model: nn.Module | None = None,
                 wrap: WrapPolicy = None, reshard_after_forward: bool = True, offload: bool = False,
                 param_dtype: torch.dtype | None = None, placements: Placements,
                 deferred: bool = False, device: torch.device | None = None) -> None:
        """model, wrap, reshard_after_forward: stage 3 only (see paratrain.sharding.gather).
        offload: the optimizer's masters and state live in CPU memory and the update runs there
        (ZeRO-Offload, Ren et al. 2021); the device keeps only its working copy of the shard.
        param_dtype: store parameters and gradients in this dtype (bf16 / fp16); the optimizer's
        masters stay in the parameters' original dtype (float32).
        placements: where each parameter's gradient is reduced and sharded, and how it counts in the
        norm (paratrain.comm.placement: Placements(Placement.data_parallel(mesh)) when every parameter
        is replicated over dp); a flat group holds parameters of one placement.
        deferred: reduce once per step, after the last backward (pipeline schedules interleave the
        micro-batches' backwards); stage 2 then keeps full gradients during the step and only the
        shards between steps.
        device: where the flat buffers go when the parameters are on the meta device (FlatGroup)."""
        self.placements = placements
        self.deferred = deferred
        if deferred and stage == 3:
            raise ValueError("ZeRO-3 gathers parameters around each module's forward and backward, which a "
                             "pipeline schedule interleaves across micro-batches: use zero 1 or 2 with pp")
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroSync implements stages 1, 2 and 3, got {stage}")
        if reduce_op not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce_op must be 'all_reduce' or 'reduce_scatter', got {reduce_op!r}")
        self.stage = stage
        self.optimizer = optimizer
        self.names = names
        self.reduce_op = reduce_op
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [names[id(p)] for p in params if id(p) not in group_of]
        if missing:
            raise ValueError(f"the optimizer does not hold these trainable parameters: {missing[:5]}")
        self.gatherer: ParamGatherer | None = None
        master_device = torch.device("cpu") if offload else None
        if stage < 3:
            planned = plan_buckets(params, cap_bytes=bucket_bytes, key=lambda p: (group_of[id(p)], placements(p)))
            self.groups = [FlatGroup(i, ps, shards=placements(ps[0]).shards, shard_index=placements(ps[0]).shard_index,
                                     master_device=master_device, param_dtype=param_dtype,
                                     optimizer_group=group_of[id(ps[0])], device=device)
                           for i, ps in enumerate(planned)]
        else:
            if model is None:
                raise ValueError("ZeRO-3 needs the model, to gather parameters around its modules")
            root, units, members = units_of(model, params, wrap)
            # Gradients complete in backward order: units reversed, the root (embedding) last.
            self.groups = []
            for unit in [*reversed(units), root]:
                by_group: dict[tuple[int, Placement], list[nn.Parameter]] = {}
                for param in members[id(unit)]:
                    by_group.setdefault((group_of[id(param)], placements(param)), []).append(param)
                for (gi, placement), ps in by_group.items():
                    unit.groups.append(FlatGroup(len(self.groups), ps, shards=placement.shards,
                                                 shard_index=placement.shard_index,
                                                 optimizer_group=gi, persistent=False, master_device=master_device,
                                                 param_dtype=param_dtype, device=device))
                    self.groups.append(unit.groups[-1])
            self.gatherer = ParamGatherer(root, units, [placements(g.params[0]).shard for g in self.groups],
                                          reshard_after_forward=reshard_after_forward)
            self._unit_of = {g.index: u for u in [root, *units] for g in u.groups}
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        self._placement = [placements(g.params[0]) for g in self.groups]
        """Each flat group's Placement, by index."""
        self._position = {id(p): i for g in self.groups for i, p in enumerate(g.params)}
        # The optimizer now updates the shards; its per-parameter state starts empty.
        for gi, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [g.master for g in self.groups if g.optimizer_group == gi]
        optimizer.state.clear()

        # Gradient buffers are zeroed by the first begin_step, not here: on a CPU their pages then cost
        # nothing until training starts (building a large model holds only its parameter shards).
        self.grad_flats: list[torch.Tensor | None] = [None] * len(self.groups)
        self.grad_shards: list[torch.Tensor] = []
        self._grads_zeroed = False
        for g in self.groups:
            if stage == 1:
                self.grad_flats[g.index] = torch.empty(g.padded, dtype=g.param_flat.dtype, device=g.param_flat.device)
            if stage == 1 and reduce_op == "all_reduce":
                shard = g.shard_of(self.grad_flats[g.index])  # type: ignore[arg-type]
            else:
                shard = torch.empty(g.shard_numel, dtype=g.param_flat.dtype, device=g.param_flat.device)
            self.grad_shards.append(shard)
            if not g.own_master:
                g.master.grad = shard

        self._sync = True
        """False: the backward in progress only accumulates (begin_micro_batch)."""
        self._ready = [0] * len(self.groups)
        self._next = 0
        self._finish_queued = False
        self._in_flight: list[_InFlight] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # ---- backward -------------------------------------------------------------------------
    def begin_step(self) -> None:
        if not self._grads_zeroed:
            for buffer in [*self.grad_shards, *(f for f in self.grad_flats if f is not None)]:
                buffer.zero_()
            self._grads_zeroed = True
        if self.stage == 1:
            for g in self.groups:
                flat = self.grad_flats[g.index]
                assert flat is not None
                for param, view in zip(g.params, g.views(flat)):
                    if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                        param.grad = view
        for g, shard in zip(self.groups, self.grad_shards):
            if not g.own_master:
                g.master.grad = shard

    def begin_micro_batch(self, *, sync: bool) -> None:
        """sync False: the coming backward only accumulates (ZeRO-2/3 still reduce-scatter each micro-batch,
        unless deferred by a pipeline); True: the step's last."""
        self._sync = sync

    def _communicates(self) -> bool:
        return (self.stage >= 2 and not self.deferred) or self._sync

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        group = self._group_of[id(param)]
        if self.stage >= 2:
            # Move the gradient into its group's buffer and free the parameter-sized one.
            flat = self.grad_flats[group.index]
            if flat is None:
                flat = self.grad_flats[group.index] = torch.zeros(
                    group.padded, dtype=group.param_flat.dtype, device=group.param_flat.device)
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
            flat = torch.zeros(group.padded, dtype=group.param_flat.dtype, device=group.param_flat.device)
        if self.stage >= 2:
            self.grad_flats[index] = None  # the next micro-batch starts a fresh buffer
        shard = pending = None
        placement = self._placement[index]
        if self.reduce_op == "all_reduce":
            if placement.reduce is not None:
                pending = all_reduce_async(flat, placement.reduce)
        elif placement.shard is not None:
            shard = torch.empty(group.shard_numel, dtype=flat.dtype, device=flat.device)
            pending = reduce_scatter_async(shard, flat, placement.shard)
        elif placement.reduce is not None:  # shard group of 1 (S = 1): plain all-reduce of the shard
            pending = all_reduce_async(flat, placement.reduce)
        self._in_flight.append(_InFlight(group, flat, shard, pending))
        self._next += 1
        if self.gatherer is not None:  # every gradient of the unit is in: its parameters can go
            unit = self._unit_of[index]
            if all(g.index < self._next for g in unit.groups):
                self.gatherer.free(unit)

    def _launch_rest(self) -> None:
        while self._next < len(self.groups):
            self._launch(self._next)

    def _complete(self) -> None:
        """Wait for every reduction in flight and add its sum into this rank's gradient shards."""
        for item in self._in_flight:
            if item.pending is not None:
                item.pending.wait()
            if item.shard is not None:
                replicate = self._placement[item.group.index].replicate
                if replicate is not None:  # MiCS: the shard's sum over the other replicas
                    all_reduce(item.shard, replicate)
                summed = item.shard
            else:
                summed = item.group.shard_of(item.flat)
            target = self.grad_shards[item.group.index]
            if summed.data_ptr() != target.data_ptr():
                target.add_(summed)
        self._in_flight.clear()
        self._ready = [0] * len(self.groups)
        self._next = 0
        self._finish_queued = False

    def end_backward(self) -> None:
        if self.stage >= 2 and not self.deferred:  # every micro-batch was reduced: fold it into the shards now
            if self._next < len(self.groups):
                self._launch_rest()
            self._complete()
        if self.gatherer is not None:
            self.gatherer.free_all()

    def finish(self) -> None:
        if self.stage == 1 or self.deferred:
            if self._next < len(self.groups):  # a synced backward that produced no gradient at all
                self._launch_rest()
            self._complete()
        # (stages 2-3 otherwise: end_backward already reduced every micro-batch)
        for g in self.groups:  # a weight tied across stages: sum its two ends' shards
            tied = self._placement[g.index].tied
            if tied is not None:
                all_reduce(self.grad_shards[g.index], tied)

    # ---- after backward -------------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        return self.grad_shards

    def norm_parts(self) -> list[NormPart]:
        """Shards add up over their shard group, pieces over the axes that split them."""
        return self.placements.norm_parts(((g.params[0], self.grad_shards[g.index]) for g in self.groups),
                                          sharded=True)

    def before_optimizer_step(self) -> None:
        """Separate masters (float32, or offloaded): hand them the reduced, scaled, clipped shards."""
        for g, shard in zip(self.groups, self.grad_shards):
            if g.own_master:
                g.master.grad = shard.to(g.master.device, dtype=g.master.dtype, copy=True)

    def after_step(self) -> None:
        """All-gather the updated shards into full parameters (ZeRO-3: at next use); zero the gradients."""
        for g in self.groups:
            g.push_master()
        if self.stage < 3:
            gathers = [all_gather_async(g.param_flat, g.shard.clone(), self._placement[g.index].shard)
                       for g in self.groups if self._placement[g.index].shard is not None]
            for pending in gathers:
                pending.wait()
        for shard in self.grad_shards:
            shard.zero_()
        for flat in self.grad_flats:
            if flat is not None:
                flat.zero_()

    def memory(self) -> dict[str, int]:
        """Bytes held between steps: parameters (stages 1-2: full, padded; stage 3: shards), gradients
        (stage 1: full buffers; stages 2-3: shards only), and masters that do not share the
        parameters' storage (offload: in CPU memory; they count with the optimizer)."""
        params = sum(g.param_flat.untyped_storage().nbytes() for g in self.groups)
        if self.stage == 3:  # shards in storage of their own (the full buffers are freed between steps)
            params += sum(g.shard.numel() * g.shard.element_size() for g in self.groups)
        grads = sum(f.numel() * f.element_size() for f in self.grad_flats if f is not None)
        for g, shard in zip(self.groups, self.grad_shards):
            flat = self.grad_flats[g.index]
            if flat is None or shard._base is not flat:  # a buffer of its own (meta tensors have no pointers)
                grads += shard.numel() * shard.element_size()
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups if g.own_master)
        return {"params": params, "grads": grads, "masters": masters}

    @property
    def params_sharded(self) -> bool:
        """ZeRO-3: a forward all-gathers parameters, so every rank must run it."""
        return self.gatherer is not None

    # ---- layout-free model state ------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Every parameter this strategy holds, full, by name, in the masters' precision (the true
        weights when the parameters are stored rounded). Collective over the shard group."""
        state = {}
        for g in self.groups:
            full = self._gather(g.master.detach(), g)
            for param, view in zip(g.params, g.views(full)):
                state[self.names[id(param)]] = view.clone()
        return state

    @torch.no_grad()
    def load_model_state(self, state: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """Set every parameter from full tensors by name: masters exactly, stored copies rounded.
        Returns the names loaded (every trainable parameter)."""
        for g in self.groups:
            exact = g.flatten([state[self.names[id(p)]].to(g.master.device, g.master.dtype) for p in g.params])
            if g.persistent:
                g.param_flat.copy_(exact)
            g.shard.copy_(g.shard_of(exact))
            if g.own_master:
                g.master.copy_(g.shard_of(exact))
        return frozenset(self.names[id(p)] for g in self.groups for p in g.params)

    def _gather(self, shard: torch.Tensor, g: FlatGroup) -> torch.Tensor:
        """[padded] concatenation of every shard-group rank's `shard` (a copy when unsharded)."""
        full = torch.empty(g.padded, dtype=shard.dtype, device=shard.device)
        group = self._placement[g.index].shard
        if group is not None:
            all_gather_async(full, shard.contiguous(), group).wait()
        else:
            full.copy_(shard)
        return full

    # ---- layout-free optimizer state --------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state of every parameter, full, by name (collective over the shard group)."""
        state: dict[str, dict[str, Any]] = {}
        for g in self.groups:
            for key, value in self.optimizer.state.get(g.master, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
                    full = self._gather(value, g)
                    for param, view in zip(g.params, g.views(full)):
                        state.setdefault(self.names[id(param)], {})[key] = view.clone()
                else:
                    for param in g.params:
                        copy = value.clone() if isinstance(value, torch.Tensor) else value
                        state.setdefault(self.names[id(param)], {})[key] = copy
        param_groups = []
        for gi, group in enumerate(self.optimizer.param_groups):
            names = [self.names[id(p)] for g in self.groups if g.optimizer_group == gi for p in g.params]
            param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": param_groups}

    def load_optimizer_state(self, named: Mapping[str, Any]) -> None:
        """Inverse of optimizer_state: keep this rank's shard of every per-element state tensor."""
        saved_groups = named["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved optimizer has {len(saved_groups)} param groups, this one "
                             f"{len(self.optimizer.param_groups)}")
        ours = sorted(self.names[id(p)] for g in self.groups for p in g.params)
        if sorted(n for group in saved_groups for n in group["params"]) != ours:
            raise KeyError("the saved optimizer state does not hold the same parameters as this model")
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.state.clear()
        saved_state = named["state"]
        for g in self.groups:
            per_param = [saved_state.get(self.names[id(p)], {}) for p in g.params]
            if not any(per_param):
                continue
            restored: dict[str, Any] = {}
            for key, first in per_param[0].items():
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    flat = g.flatten([s[key].to(g.master.device) for s in per_param])
                    restored[key] = g.shard_of(flat).to(first.dtype).clone()
                else:
                    restored[key] = first.clone() if isinstance(first, torch.Tensor) else first
            self.optimizer.state[g.master] = restored
