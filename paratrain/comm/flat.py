"""FlatGroup: some parameters flattened into one buffer, split evenly across a shard group.

Shared by the strategies that keep slices of the parameters with their optimizer state elsewhere than
on every rank: ZeRO (paratrain.sharding: a shard group of dp ranks) and the parameter server
(paratrain.param_server: the servers). optimizer_groups and point_optimizer_at tie a FlatGroup's master to
the optimizer.

    param_flat[padded]   = p0 | p1 | ... | pk | zeros      padded = ceil(numel / S) * S
    rank i of the shard group owns param_flat[i * n : (i + 1) * n], n = padded / S

The parameters become views into param_flat, and `master` (what the optimizer updates) is a
Parameter sharing storage with this rank's slice: the optimizer writes straight into the model's
weights, and an all-gather of the slices makes every rank's copy whole again. The zero padding
makes every slice the same size, which is what reduce-scatter and all-gather need; it stays zero
(its gradient is zero), so it changes no norm and no update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatStorage:
    """Where and how a FlatGroup keeps its buffers (the same for every group of one ZeroSync)."""

    persistent: bool = True
    """False (ZeRO-3): param_flat's storage is freed, and `shard` keeps this rank's slice in storage
    of its own; the gatherer refills param_flat before the parameters are used."""
    master_device: torch.device | None = None
    """Keep the optimizer's copy of the shard there (offload to the CPU); None: with the shard."""
    param_dtype: torch.dtype | None = None
    """Store the parameters in this dtype (bf16 / fp16), the masters in theirs; None: theirs."""
    device: torch.device | None = None
    """Where the buffers live when the parameters are on the meta device (shapes only): then nothing
    is copied, the storage this rank keeps (param_flat when persistent, else shard, and a separate
    master) is allocated but not initialised, padding aside, and the group is not `materialized`
    until paratrain.hybrid.materialize fills it and calls mark_materialized()."""


class FlatGroup:
    def __init__(self, index: int, params: list[nn.Parameter], *, shards: int, shard_index: int,
                 optimizer_group: int, storage: FlatStorage = FlatStorage()) -> None:
        """shards, shard_index: the size of the shard group and this rank's place in it.
        storage: where and how the buffers are kept (FlatStorage)."""
        self.index = index
        self.params = params
        self.optimizer_group = optimizer_group
        """Index of the optimizer param group all these parameters belong to."""
        self.shapes = [param.shape for param in params]
        self.offsets: list[int] = []
        total = 0
        for param in params:
            self.offsets.append(total)
            total += param.numel()
        self.numel = total
        self.padded = math.ceil(total / shards) * shards
        self.shard_numel = self.padded // shards
        self.lo = shard_index * self.shard_numel
        self.hi = self.lo + self.shard_numel
        master_dtype = params[0].dtype
        self._materialized = not params[0].is_meta
        if not self._materialized and storage.device is None:
            raise ValueError("FlatGroup of meta parameters needs device= in its FlatStorage (where its buffers "
                             "are allocated): FlatStorage(device=torch.device(...))")
        device = params[0].device if self._materialized else storage.device
        dtype = storage.param_dtype or master_dtype
        master_device = storage.master_device
        persistent = storage.persistent
        own_master = master_device is not None or dtype != master_dtype
        with torch.no_grad():
            if self._materialized:
                exact = self.flatten([p.detach() for p in params])  # in the parameters' own dtype
                self.param_flat = exact.to(dtype)
            else:  # untouched pages: a ZeRO-3 group's full buffer is freed below before it costs memory
                self.param_flat = torch.empty(self.padded, dtype=dtype, device=device)
                self.param_flat[self.numel:].zero_()
                for param in params:  # a real (empty) tensor first: .data cannot move a meta parameter
                    torch.utils.swap_tensors(param, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                                 requires_grad=param.requires_grad))
            for param, view in zip(params, self.views(self.param_flat)):
                param.data = view
        shard = self.param_flat[self.lo: self.hi]
        if persistent:
            self.shard = shard
        else:
            self.shard = shard.clone() if self._materialized else torch.zeros_like(shard)
        """This rank's slice of the parameters on their device: a view of param_flat when
        persistent, storage of its own otherwise (what the all-gather of ZeRO-3 reads)."""
        if not self._materialized:
            self.master = nn.Parameter(torch.zeros(self.shard_numel, dtype=master_dtype, device=master_device or device)
                                       if own_master else self.shard)
        else:
            exact_shard = exact[self.lo: self.hi]
            self.master = nn.Parameter(exact_shard.to(master_device or device, copy=True) if own_master else self.shard)
        """What the optimizer updates: `shard` itself, or a copy of it of its own: in float32 when
        the parameters are stored in a low precision (initialised from the exact values, not from
        the rounded ones), on master_device when offloaded. push_master() copies it back."""
        self._own_master = own_master
        self.persistent = persistent
        self._full_bytes = self.param_flat.untyped_storage().nbytes()
        if not persistent:
            self.free()

    @property
    def materialized(self) -> bool:
        """Whether this rank's storage holds the parameters' values (False for a group built on meta
        parameters until paratrain.hybrid.materialize has filled it)."""
        return self._materialized

    def mark_materialized(self) -> None:
        """Record that paratrain.hybrid.materialize has filled this group's storage (param_flat or
        shard, and a separate master) with the parameters' values."""
        self._materialized = True

    @property
    def is_gathered(self) -> bool:
        return self.param_flat.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Release the full parameters' memory. The parameters stay views of param_flat, whose
        storage shrinks to nothing; autograd's saved references see the refilled storage later."""
        if not self.persistent:
            self.param_flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give param_flat its storage back (contents undefined until gathered)."""
        if not self.is_gathered:
            self.param_flat.untyped_storage().resize_(self._full_bytes)

    @property
    def own_master(self) -> bool:
        """The master is a separate tensor (float32 masters, or offloaded), not the shard itself."""
        return self._own_master

    @torch.no_grad()
    def push_master(self) -> None:
        """After an update of a separate master: copy (and round) it back into the device shard."""
        if self.own_master:
            self.shard.copy_(self.master, non_blocking=True)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's region of a [padded] buffer, shaped like the parameter."""
        return [flat[o: o + shape.numel()].view(shape) for o, shape in zip(self.offsets, self.shapes)]

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.lo: self.hi]

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """[padded] buffer holding `tensors` (shaped like the parameters) back to back."""
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype, device=tensors[0].device)
        for view, tensor in zip(self.views(flat), tensors):
            view.copy_(tensor)
        return flat


def optimizer_groups(params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
                     names: dict[int, str]) -> dict[int, int]:
    """The index of the optimizer param group holding each parameter, by id; every trainable
    parameter must be in one."""
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    missing = [names[id(p)] for p in params if id(p) not in group_of]
    if missing:
        raise ValueError(f"the optimizer does not hold these trainable parameters: {missing[:5]}")
    return group_of


def point_optimizer_at(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> None:
    """The optimizer now updates the shards (each group's master); its per-parameter state starts empty."""
    for gi, param_group in enumerate(optimizer.param_groups):
        param_group["params"] = [g.master for g in groups if g.optimizer_group == gi]
    optimizer.state.clear()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state over the parameters its groups hold now (state left behind for
    parameters it no longer updates, as after point_optimizer_at, is not counted)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return sum(v.numel() * v.element_size() for p, state in optimizer.state.items() if id(p) in held
               for v in state.values() if isinstance(v, torch.Tensor))
