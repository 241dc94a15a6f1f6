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

The parts: options.py (ZeroOptions, and the rules each stage follows), groups.py (which parameters
share a flat group), flat.py (a group's buffers), reduce.py (gradients to summed shards), gather.py
(ZeRO-3's parameters around their units), state.py (layout-free checkpoints).

Requires an element-wise optimizer (SGD, Adam, AdamW, ...): the update of an element must depend
only on that element's state, since flat shards cut through parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm import NormPart, all_gather_async
from paratrain.comm.placement import Placements
from paratrain.comm.flat import FlatStorage
from paratrain.sharding.float8_gather import Float8Gather
from paratrain.sharding.gather import ParamGatherer, WrapPolicy
from paratrain.comm.flat import optimizer_groups, point_optimizer_at
from paratrain.sharding.groups import bucket_groups, unit_groups
from paratrain.sharding.options import ZeroOptions
from paratrain.sharding.reduce import GradReducer
from paratrain.sharding.state import ShardedState


class ZeroSync:
    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, names: dict[int, str],
                 options: ZeroOptions, *, model: nn.Module | None, wrap: WrapPolicy, placements: Placements,
                 device: torch.device | None) -> None:
        """names: each parameter's name, by id (errors and layout-free state).
        options: the stage and how it runs (ZeroOptions, validated there).
        model, wrap: stage 3 only, the units whose parameters are gathered around their use (see
        paratrain.sharding.gather); None otherwise.
        placements: where each parameter's gradient is reduced and sharded, and how it counts in the
        norm (paratrain.comm.placement: Placements(Placement.data_parallel(mesh)) when every parameter
        is replicated over dp); a flat group holds parameters of one placement.
        device: where the flat buffers go when the parameters are on the meta device (FlatStorage);
        unused otherwise."""
        self.options = options
        self.placements = placements
        self.optimizer = optimizer
        self.names = names
        group_of = optimizer_groups(params, optimizer, names)
        storage = FlatStorage(persistent=not options.params_sharded,
                              master_device=torch.device("cpu") if options.offload else None,
                              param_dtype=options.param_dtype, device=device)
        self.gatherer: ParamGatherer | None = None
        if options.params_sharded:
            self.groups, root, units = unit_groups(params, group_of, placements, model=model, wrap=wrap,
                                                   storage=storage, float8=options.float8_gather)
            shard_groups = [placements(g.params[0]).shard for g in self.groups]
            float8 = {g.index: Float8Gather(g, shard, also=options.float8_gather[id(g.params[0])])
                      for g, shard in zip(self.groups, shard_groups)
                      if shard is not None and id(g.params[0]) in options.float8_gather}
            self.gatherer = ParamGatherer(root, units, shard_groups,
                                          reshard_after_forward=options.reshard_after_forward, float8=float8)
        else:
            self.groups = bucket_groups(params, group_of, placements, bucket_bytes=options.bucket_bytes,
                                        storage=storage)
        self._placement = [placements(g.params[0]) for g in self.groups]
        """Each flat group's Placement, by index."""
        point_optimizer_at(optimizer, self.groups)
        self.reducer = GradReducer(params, self.groups, self._placement, options, self.gatherer)
        self.sharded_state = ShardedState(self.groups, self._placement, optimizer, names)

    # ---- backward -------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.reducer.begin_step()

    def begin_micro_batch(self, *, sync: bool) -> None:
        """sync False: the coming backward only accumulates (ZeRO-2/3 still reduce-scatter each micro-batch,
        unless deferred by a pipeline); True: the step's last."""
        self.reducer.begin_micro_batch(sync=sync)

    def end_backward(self) -> None:
        self.reducer.end_backward()
        if self.gatherer is not None:
            self.gatherer.free_all()

    def finish(self) -> None:
        self.reducer.finish()

    # ---- after backward -------------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        return self.reducer.grad_shards

    def norm_parts(self) -> list[NormPart]:
        """Shards add up over their shard group, pieces over the axes that split them."""
        shards = self.reducer.grad_shards
        return self.placements.norm_parts(((g.params[0], shards[g.index]) for g in self.groups), sharded=True)

    def before_optimizer_step(self) -> None:
        """Separate masters (float32, or offloaded): hand them the reduced, scaled, clipped shards."""
        for g, shard in zip(self.groups, self.reducer.grad_shards):
            if g.own_master:
                g.master.grad = shard.to(g.master.device, dtype=g.master.dtype, copy=True)

    def after_step(self) -> None:
        """All-gather the updated shards into full parameters (ZeRO-3: at next use); zero the gradients."""
        for g in self.groups:
            g.push_master()
        if not self.options.params_sharded:
            gathers = [all_gather_async(g.param_flat, g.shard.clone(), self._placement[g.index].shard)
                       for g in self.groups if self._placement[g.index].shard is not None]
            for pending in gathers:
                pending.wait()
        self.reducer.after_step()

    def memory(self) -> dict[str, int]:
        """Bytes held: parameters (stages 1-2: full, padded; stage 3: shards), gradients while a step runs
        (stage 1: full buffers; stages 2-3: shards only) and between steps ("grads_kept"), and masters that
        do not share the parameters' storage (offload: in CPU memory; they count with the optimizer)."""
        params = sum(g.param_flat.untyped_storage().nbytes() for g in self.groups)
        if self.options.params_sharded:  # shards in storage of their own (the full buffers are freed between steps)
            params += sum(g.shard.numel() * g.shard.element_size() for g in self.groups)
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups if g.own_master)
        return {"params": params, **self.reducer.memory(), "masters": masters}

    def close(self) -> None:
        """Remove the gradient hooks and ZeRO-3's gather hooks (GradientStrategy.close)."""
        self.reducer.close()
        if self.gatherer is not None:
            self.gatherer.close()

    @property
    def params_sharded(self) -> bool:
        """ZeRO-3: a forward all-gathers parameters, so every rank must run it."""
        return self.gatherer is not None

    # ---- layout-free state (paratrain.sharding.state) ----------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, by name, in the masters' precision (collective over the shard group)."""
        return self.sharded_state.model_state()

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer state of every parameter, full, by name (collective over the shard group)."""
        return self.sharded_state.optimizer_state()

