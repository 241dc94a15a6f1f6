"""Activation offload: the activations that chosen modules save for backward wait in host memory,
and come back to the device, one module ahead of need, in backward.

Applied from outside by module name, like recomputation (paratrain.memory.recompute), by a pair of
forward hooks on each matching module, so the module and its names stay the model's own: the
pre-hook enters `saved_tensors_hooks(pack, unpack)` of one `HostCopies`
(paratrain.memory.host_copies), the forward hook (always called, so that an exception cannot leave
it entered) leaves it. Under torch.compile both hooks run eagerly, around the compiled forward:

    forward, module i   compute                                    (current stream)
                        pack: D2H copy into a pinned host buffer   (side stream, after the producer)
                        when module i + 2 starts, the current stream waits for module i's copies,
                        and module i's device storages are freed
    backward, module i  grad of its output ready (a hook):         H2D of module i's storages, if
                        nothing started them, then of module i-1's (side stream), overlapping
                        module i's backward compute
                        unpack: the current stream waits for that storage's copy

Module i-1 means: the module that ran just before i in the same forward (earlier in the model's
order); a new micro-batch starting again at block 0 is not "after" the previous one's last block.

The unit of transfer is a storage, not a tensor (paratrain.memory.host_copies says why).

Why a side stream: the copies then overlap compute. Why the current stream waits, two modules
later, for the copies out: PCIe (~25 GB/s) is far slower than an H100 makes activations; without
the wait the forward would run ahead, every device storage would stay alive until its copy
finished, and the peak would not drop. Whatever is still on the device when backward reaches it
(the last modules' storages, typically) is used in place rather than brought back.

On CPU there is nowhere to offload to, but the same path runs (pack copies into a separate host
buffer, the backward hook copies it back into another), so CPU tests check packing, prefetch order
and exact parity.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from paratrain.eager import eager
from paratrain.memory.host_copies import MIN_OFFLOAD_BYTES, HostCopies, OffloadStats
from paratrain.memory.recompute import recompute_pattern, recomputed_names
from paratrain.nn.recipe import recipe_of

__all__ = ["MIN_OFFLOAD_BYTES", "ActivationOffload", "OffloadStats", "apply_activation_offload"]


class ActivationOffload:
    """The offloaded modules of one model: the hooks on each, and their counters (`stats()`)."""

    def __init__(self, model: nn.Module, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.copies = HostCopies(model, min_bytes=min_bytes)
        self.names: list[str] = []
        """Modules offloaded, in the model's order."""
        self._open: list[tuple[nn.Module, Any]] = []
        """The calls under way, innermost last: (module, (its saved_tensors_hooks, its group), or None
        when grad was off)."""

    def stats(self) -> OffloadStats:
        """A copy of the counters."""
        return self.copies.stats()

    def reset_stats(self) -> None:
        self.copies.reset_stats()

    def add(self, name: str, module: nn.Module) -> None:
        """Offload what `module` (named `name`) saves, from its next call on."""
        module.register_forward_pre_hook(_Enter(self, len(self.names)))
        module.register_forward_hook(_Leave(self), always_call=True)
        self.names.append(name)

    def enter(self, position: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The module at `position` starts a call: what it saves from now on goes to host memory."""
        if not torch.is_grad_enabled():
            self._open.append((module, None))  # nothing will be saved
            return
        group = self.copies.open_group(module, position, _device_of(module, args))
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.copies.pack, group),
                                                         self.copies.unpack)
        hooks.__enter__()
        self._open.append((module, (hooks, group)))

    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The module's call ended (or raised: `output` is None): stop packing; prefetch from its
        outputs' first gradient on."""
        if not self._open or self._open[-1][0] is not module:
            return  # the pre-hook did not run (a hook before it raised)
        _, entered = self._open.pop()
        if entered is None:
            return
        hooks, group = entered
        hooks.__exit__(None, None, None)
        needing_grad = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing_grad:
            # Fires when the first gradient w.r.t. an output is ready: this module's backward begins.
            torch.autograd.graph.register_multi_grad_hook(
                needing_grad, functools.partial(self.copies.backward_begins, group), mode="any")


class _Enter:
    """An offloaded module's forward pre-hook (a type of its own: apply_activation_offload finds it)."""

    def __init__(self, offload: ActivationOffload, position: int) -> None:
        self.offload, self.position = offload, position

    @eager  # under torch.compile: around the compiled forward, not traced into it
    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.offload.enter(self.position, module, args)


class _Leave:
    """An offloaded module's forward hook."""

    def __init__(self, offload: ActivationOffload) -> None:
        self.offload = offload

    @eager
    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.offload.leave(module, args, output)


def offloaded(module: nn.Module) -> bool:
    """Whether apply_activation_offload has hooked `module`."""
    return any(isinstance(hook, _Enter) for hook in module._forward_pre_hooks.values())


def apply_activation_offload(model: nn.Module, pattern: str | None = None, *, required: bool = True,
                             min_bytes: int = MIN_OFFLOAD_BYTES) -> ActivationOffload:
    """Offload what every module whose full name matches `pattern` saves for backward (None: the
    model's recipe's blocks).

    required: a pattern that matches nothing is an error (a pipeline stage may hold no block).
    min_bytes: storages smaller than this stay on the device (see MIN_OFFLOAD_BYTES).
    A module is recomputed or offloaded, not both: recomputation already keeps only the module's
    inputs, and neither may contain the other.
    """
    pattern = recompute_pattern("full", recipe_of(model)) if pattern is None else pattern
    offload = ActivationOffload(model, min_bytes=min_bytes)
    recomputed = recomputed_names(model)
    for name, module in model.named_modules():
        if not (name and re.fullmatch(pattern, name)):
            continue
        if offloaded(module):
            raise ValueError(f"module {name!r} is already offloaded: apply activation offload once per module")
        overlap = [r for r in recomputed if r == name or r.startswith(name + ".") or name.startswith(r + ".")]
        if overlap:
            raise ValueError(
                f"module {name!r} cannot be offloaded: {overlap[0]!r} is recomputed, and recomputation "
                "already keeps only its inputs; choose one of recompute and offload for these modules "
                "(or a pattern that leaves them out)")
        offload.add(name, module)
    if not offload.names and required:
        raise ValueError(f"activation offload pattern {pattern!r} matched no module of {type(model).__name__}")
    return offload


def _device_of(module: nn.Module, args: tuple[Any, ...]) -> torch.device:
    """Where the module computes: its first parameter's device, else its first tensor argument's."""
    for param in module.parameters():
        return param.device
    for arg in tree_leaves(args):
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")
