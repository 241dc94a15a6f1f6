"""Counting the places where Python reads a tensor's value: on a GPU, each one waits for the device.

A training step that reads nothing back can be queued whole while the device still runs the one
before it; one `.item()` per step ties the host to the device and leaves the GPU idle while Python
prepares the next step. On CUDA, torch.cuda.set_sync_debug_mode("error") finds such reads; on any
device (the CPU included, where nothing waits) HostReads counts them by name, so a test can hold
the engine to zero reads in a step that does not log.

    with HostReads() as reads:
        engine.step(batch, loss_fn)
    assert reads.count == 0, reads.where
"""

from __future__ import annotations

import traceback
from typing import Any

from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "nonzero",
                   "numpy", "any_is_true"})
"""Tensor methods that hand a value to Python (and torch.nonzero, whose result's size is data)."""


class HostReads(TorchFunctionMode):
    """Counts, while active, every call that moves a tensor's value to Python (READS), except those
    torch.optim makes of its step counters: torch keeps them in CPU memory (unless the optimizer is
    capturable or fused) precisely so that reading them never waits for a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []
        """'name at file:line' of each read, innermost frame outside torch."""

    @property
    def count(self) -> int:
        return len(self.where)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS:
            stack = traceback.extract_stack()[:-1]
            if "/torch/optim/" not in stack[-1].filename:
                frame = next((f for f in reversed(stack) if "/torch/" not in f.filename), None)
                self.where.append(f"{name} at {frame.filename}:{frame.lineno}" if frame else name)
        return func(*args, **(kwargs or {}))
