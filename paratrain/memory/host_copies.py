"""The storage copies behind activation offload (paratrain.memory.offload): saved tensors packed into
host buffers, grouped by call of an offloaded module, and brought back one group ahead of need.

The unit of transfer is a storage, not a tensor: autograd often saves several views of one storage
(q, k and v are views of one qkv), and device memory is held by storages. Each storage is copied
once; every saved view is rebuilt over the copy with its own dtype, offset, sizes and strides, so
backward reads bitwise what it would have read without offload. On CUDA the copies run on a side
stream; on CPU the same path copies into separate host buffers.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

MIN_OFFLOAD_BYTES = 1024
"""Storages smaller than this stay on the device. A copy costs a launch, an event and a pinned
block (microseconds each) whatever its size, and the CUDA caching allocator rounds every device
block up to 512 bytes, so a storage under 1 KiB frees (almost) nothing. Per-row statistics such as
RMSNorm's rstd[B, S, 1] in float32 are B * S * 4 bytes: 1 KiB at B * S = 256, so real batches
offload them and toy ones do not."""


@dataclass
class OffloadStats:
    """What the pack and unpack hooks did since the last `reset_stats()`."""

    tensors: int = 0
    """Saved tensors offloaded (each view of a storage counts)."""
    kept: int = 0
    """Saved tensors left where they were: parameters and buffers (and views of them), storages
    under min_bytes, tensors on another device, tensor subclasses, non-strided layouts."""
    storages: int = 0
    """Distinct storages copied to host memory."""
    bytes: int = 0
    """Bytes copied to host memory (each storage once): the device memory offload can free."""
    prefetched: int = 0
    """Storages whose copy back a backward hook started before any unpack asked for them."""
    resident: int = 0
    """Storages whose copy out had not been waited on when backward reached them: used in place on
    the device, never brought back (CUDA only)."""
    on_demand: int = 0
    """Storages that an unpack had to bring back itself (no backward hook reached them first: the
    module's output needed no grad, or backward started inside the module)."""


class HostCopies:
    """The pack/unpack hooks of activation offload over one model, and their counters (`stats()`).

    One object serves every offloaded module of a model; it keeps no tensor alive beyond the
    autograd graph that saved it, except device storages whose copy out is in flight.
    """

    def __init__(self, model: nn.Module, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.model = model
        self.min_bytes = min_bytes
        self._stats = OffloadStats()
        self._fixed: set[int] = set()  # data_ptr of every parameter and buffer storage of the model
        self._stashes: dict[tuple[StorageWeakRef, int], weakref.ref[_Stash]] = {}
        self._pending: collections.deque[tuple[int, torch.cuda.Event, weakref.ref[_Stash]]] = collections.deque()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._seq = 0
        self._last: _Group | None = None

    def stats(self) -> OffloadStats:
        """A copy of the counters."""
        return replace(self._stats)

    def reset_stats(self) -> None:
        self._stats = OffloadStats()

    def open_group(self, module: nn.Module, position: int, device: torch.device) -> _Group:
        """A call of the offloaded module at `position` (in the model's order) starts on `device`:
        the group of what it saves. On CUDA, the copies out of groups two calls back are waited for
        and their device storages freed."""
        self._seq += 1
        last = self._last
        previous = last if last is not None and last.position < position else None
        group = _Group(self._seq, position, module, device, previous)
        self._last = group
        if device.type == "cuda":
            self._drain(device, before=self._seq - 1)
        return group

    def pack(self, group: _Group, tensor: torch.Tensor) -> Any:
        """saved_tensors_hooks' pack: a handle to a host copy of the tensor's storage, or the tensor."""
        if not group.checked:  # at its first save: the module's hooks (ZeRO-3's gathers) have run
            group.checked = True
            own = [p.untyped_storage().data_ptr() for p in group.module.parameters()]
            if not self._fixed or any(ptr not in self._fixed for ptr in own):  # first call, or the model moved
                tensors = [*self.model.parameters(), *self.model.buffers()]
                self._fixed = {t.untyped_storage().data_ptr() for t in tensors}
        if not self._offloadable(tensor, group.device):
            self._stats.kept += 1
            return tensor
        storage = tensor.untyped_storage()
        # One copy per storage (and per version: a storage changed in place since is a new one).
        # The weak reference also keeps the storage's address from naming a later storage.
        key = (StorageWeakRef(storage), tensor._version)
        found = self._stashes.get(key)
        stash = found() if found is not None else None
        if stash is None:
            stash = self._copy_out(storage, group)
            self._stashes[key] = weakref.ref(stash)
            weakref.finalize(stash, self._stashes.pop, key, None)
        self._stats.tensors += 1
        return _Handle(stash, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _offloadable(self, tensor: torch.Tensor, device: torch.device) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # subclasses (DTensor, Parameter) and sparse tensors: not rebuilt from bytes
        if tensor.is_conj() or tensor.is_neg() or tensor.device != device or device.type not in ("cpu", "cuda"):
            return False  # lazy conj/neg bits would be lost; a CPU tensor in a CUDA forward is home
        storage = tensor.untyped_storage()
        return storage.nbytes() >= self.min_bytes and storage.data_ptr() not in self._fixed

    def _copy_out(self, storage: torch.UntypedStorage, group: _Group) -> _Stash:
        nbytes, device = storage.nbytes(), group.device
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
        self._stats.storages += 1
        self._stats.bytes += nbytes
        if device.type == "cpu":
            host = torch.empty(nbytes, dtype=torch.uint8)
            host.copy_(source)
            stash = _Stash(device, host)
            group.stashes.append(weakref.ref(stash))
            return stash
        self._poll()
        stream = self._side_stream(device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(device))  # the producer has written it
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        stash = _Stash(device, host, source=source, copied=copied)  # `source` keeps the storage alive
        group.stashes.append(weakref.ref(stash))
        self._pending.append((group.seq, copied, weakref.ref(stash)))
        return stash

    def _drain(self, device: torch.device, *, before: int) -> None:
        """Make the current stream wait for the copies out of groups older than `before`, then
        free their device storages (the allocator reuses them for work ordered after the wait)."""
        self._poll()
        last = None
        released = []
        while self._pending and self._pending[0][0] < before:
            _, last, ref = self._pending.popleft()
            released.append(ref)
        if last is not None:
            torch.cuda.current_stream(device).wait_event(last)  # events on one stream complete in order
        for ref in released:
            stash = ref()
            if stash is not None:
                stash.source = None

    def _poll(self) -> None:
        """Free the device storages whose copy out has completed."""
        while self._pending and self._pending[0][1].query():
            stash = self._pending.popleft()[2]()
            if stash is not None:
                stash.source = None

    def backward_begins(self, group: _Group, grad: Any) -> None:
        """The first gradient w.r.t. an output of the group's call is ready: bring back its own
        storages, then those of the call before it."""
        if group.device.type == "cuda":
            self._poll()
        for ahead in (group, group.previous):  # its own storages first: needed now
            for ref in ahead.stashes if ahead is not None else ():
                stash = ref()
                if stash is not None and stash.device_bytes is None and self._copy_in(stash):
                    self._stats.prefetched += 1

    def _copy_in(self, stash: _Stash) -> bool:
        """Start bringing `stash` back to its device; False if it never left (used in place)."""
        if stash.device.type == "cpu":
            assert stash.host is not None
            stash.device_bytes = torch.empty_like(stash.host)
            stash.device_bytes.copy_(stash.host)
            stash.host = None  # free the host buffer: the device copy lives as long as the stash
            return True
        stream = self._side_stream(stash.device)
        if stash.source is not None:
            # The copy out has not been waited on: use the original, still on the device.
            assert stash.copied is not None
            stash.device_bytes, stash.source, stash.host = stash.source, None, None
            stash.guard = _Guard(stash.device_bytes, stash.copied, stream)
            weakref.finalize(stash, stash.guard.settle).atexit = False
            self._stats.resident += 1
            return False
        assert stash.host is not None
        # Allocated on the current stream's pool, which may still have work using this memory:
        # the side stream waits for that work before writing.
        device_bytes = torch.empty(stash.host.numel(), dtype=torch.uint8, device=stash.device)
        stream.wait_stream(torch.cuda.current_stream(stash.device))
        with torch.cuda.stream(stream):
            device_bytes.copy_(stash.host, non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record(stream)
        stash.device_bytes, stash.loaded, stash.host = device_bytes, loaded, None  # pinned block freed after the copy
        stash.guard = _Guard(device_bytes, loaded, stream)
        weakref.finalize(stash, stash.guard.settle).atexit = False
        return True

    def unpack(self, handle: Any) -> torch.Tensor:
        """saved_tensors_hooks' unpack: the tensor, rebuilt over its storage back on the device."""
        if not isinstance(handle, _Handle):
            return handle  # kept as it was
        stash = handle.stash
        if stash.device_bytes is None and self._copy_in(stash):
            self._stats.on_demand += 1
        if stash.loaded is not None and stash.guard is not None:
            torch.cuda.current_stream(stash.device).wait_event(stash.loaded)
            stash.guard.consumed = True
        assert stash.device_bytes is not None
        return torch.empty(0, dtype=handle.dtype, device=stash.device).set_(
            stash.device_bytes.untyped_storage(), handle.offset, handle.size, handle.stride)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


class _Group:
    """The storages one call of one offloaded module saved, and the call that ran just before it."""

    __slots__ = ("seq", "position", "module", "device", "previous", "stashes", "checked")

    def __init__(self, seq: int, position: int, module: nn.Module, device: torch.device,
                 previous: _Group | None) -> None:
        self.seq, self.position, self.module, self.device, self.previous = seq, position, module, device, previous
        self.stashes: list[weakref.ref[_Stash]] = []  # weak: autograd's saved handles own them
        self.checked = False  # whether its first pack has looked for the model's own storages


class _Stash:
    """One offloaded storage: its bytes on the host until brought back, then on the device."""

    __slots__ = ("device", "host", "source", "copied", "device_bytes", "loaded", "guard", "__weakref__")

    def __init__(self, device: torch.device, host: torch.Tensor, *, source: torch.Tensor | None = None,
                 copied: torch.cuda.Event | None = None) -> None:
        self.device = device
        self.host: torch.Tensor | None = host
        """uint8[nbytes], pinned on CUDA; None once brought back."""
        self.source = source
        """The original device storage (uint8), held until its copy out is known to be done (CUDA).
        Should the stash die first, the storage is freed with the copy out perhaps still reading
        it: harmless, nobody will read that host copy."""
        self.copied = copied
        """Recorded on the side stream after the copy out (CUDA)."""
        self.device_bytes: torch.Tensor | None = None
        """uint8[nbytes] on the device once brought back (or the original, if still there)."""
        self.loaded: torch.cuda.Event | None = None
        """Recorded on the side stream after the copy back (CUDA)."""
        self.guard: _Guard | None = None
        """Frees device_bytes safely when the stash dies (CUDA)."""


class _Guard:
    """Makes freeing a device buffer that the side stream copies into or out of safe, whenever its
    stash dies (a finalizer calls `settle`).

    Once the current stream has waited for the copy (`consumed`), the buffer may be freed in that
    stream's order like any other. Otherwise, unless the copy's event says it is done, record_stream
    makes the allocator wait for the side stream before reusing the block. Only then: recorded
    blocks are reused only once the side stream has caught up, and since the host enqueues backward
    far ahead of the GPU, recording every buffer would have the allocator reserve fresh memory for
    nearly all of them (seen: 2.3 GiB more reserved at the same allocated peak)."""

    __slots__ = ("buffer", "event", "stream", "consumed")

    def __init__(self, buffer: torch.Tensor, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        self.buffer, self.event, self.stream = buffer, event, stream
        self.consumed = False

    def settle(self) -> None:
        if not self.consumed and not self.event.query():
            self.buffer.record_stream(self.stream)


@dataclass(slots=True)
class _Handle:
    """What autograd holds instead of a saved tensor: its stash and how to view it."""

    stash: _Stash
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
