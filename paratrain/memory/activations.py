"""How many bytes of activations autograd keeps for backward: the memory that tensor-parallel
splitting, sequence parallelism and recomputation save (Korthikanti et al. 2022 count the same)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class SavedActivations:
    storages: dict[int, int] = field(default_factory=dict)
    """data_ptr -> bytes of every storage autograd saved (each once, however many views saved it)."""

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def saved_activations(model: nn.Module) -> Iterator[SavedActivations]:
    """Record what autograd saves for backward while active, leaving out the model's parameters
    (and views of them), which exist whether or not anything is saved."""
    record = SavedActivations()
    weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in weights and storage.nbytes():
            record.storages[storage.data_ptr()] = storage.nbytes()
        # detached (the same storage and version counter): a node's own output held with its grad_fn would be a
        # reference cycle through C++ that Python's collector never frees, keeping a forward-only graph, and
        # everything it references (process groups: their threads), alive for the life of the process
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield record


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage is not a real one); any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ActivationMeter:
    """Bytes of saved activations alive over time, and their peak, while active (each storage
    counted once, from the first save to the last release). Measures what a pipeline schedule keeps
    in flight: GPipe holds every micro-batch's activations at once, 1F1B at most p - r.

        with ActivationMeter(model) as meter:
            engine.train_step(batch, loss_fn)
        meter.peak
    """

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        """Their storages are weights, not activations, whenever they are saved (read at each save: ZeRO-3 gathers a
        unit's parameters into storages of their own while it runs)."""
        self.live = 0
        self.peak = 0
        self._counts: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = _local(tensor).untyped_storage()
        ptr, size = _key(storage), storage.nbytes()
        if not size or ptr in {_key(_local(p).untyped_storage()) for p in self.params}:
            return tensor
        self._counts[ptr] = self._counts.get(ptr, 0) + 1
        if self._counts[ptr] == 1:
            self.live += size
            self.peak = max(self.peak, self.live)
        # hold a detached alias: a saved output's grad_fn is the very node saving it, and a holder
        # referring to it would make a cycle that only backward (not a retained graph) breaks
        holder = _Saved(tensor.detach())
        weakref.finalize(holder, self._release, ptr, size)
        return holder

    def _release(self, ptr: int, size: int) -> None:
        self._counts[ptr] -= 1
        if self._counts[ptr] == 0:
            del self._counts[ptr]
            self.live -= size


def _key(storage: torch.UntypedStorage) -> int:
    """Which storage: its address, or on the meta device (no address: a dry run) its storage object's, which
    every view of it shares."""
    return storage.data_ptr() or storage._cdata


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of every tensor storage alive in this process on `device_type`, each storage once (a flat
    buffer and its views, a DTensor's local shard, count once): what a process holds between steps,
    the same measure for paratrain and for its peers (bench/bench_zero.py). A collection, then a scan of
    the garbage collector's objects: for measurements, not for a training loop."""
    import gc

    gc.collect()  # what only a cycle still refers to is not held: the next collection frees it
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated module aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == device_type and not obj.is_meta:
                    storage = obj.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, ReferenceError, NotImplementedError):
                continue
    seen.pop(0, None)  # freed (resized to 0) storages
    return sum(seen.values())
