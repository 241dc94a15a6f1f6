"""Flat gradient buckets: parameters' .grad as views into a few contiguous buffers.

One contiguous buffer per bucket means one collective per bucket instead of one per parameter, and
the gradient needs no copy in or out: autograd accumulates straight into the buffer (as torch DDP's
gradient_as_bucket_view). Buckets are filled in reverse registration order, which approximates
the order backward produces gradients in, so the first bucket is the first one ready.

A bucket's buffer exists only while a step runs (allocate() when it begins, release() after the
update, the parameters' .grad then None), as torch's `zero_grad(set_to_none=True)` frees them: what a
user's evaluation or a second model gets between steps is the memory gradients would have held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    """buffer[numel]: the gradients of `params`, back to back (empty while released)."""
    offsets: list[int] = field(default_factory=list)
    """Start of each parameter's gradient in `buffer`."""
    numel: int = 0
    """The buffer's length while allocated."""

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer while allocated."""
        return self.numel * self.buffer.element_size()

    @property
    def allocated(self) -> bool:
        return self.buffer.numel() == self.numel

    def allocate(self) -> None:
        """A zeroed buffer, if released, that the parameters' .grad view (an allocated one is kept as it is)."""
        if not self.allocated:
            self.buffer = torch.zeros(self.numel, dtype=self.buffer.dtype, device=self.buffer.device)
        self.attach()

    def release(self) -> None:
        """Free the buffer: the parameters' .grad become None until the next allocate()."""
        for param in self.params:
            param.grad = None
        self.buffer = self.buffer.new_empty(0)

    def grad_view(self, i: int) -> torch.Tensor:
        param = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + param.numel()].view_as(param)

    def attach(self) -> None:
        """Point each parameter's .grad at its slice of the buffer (again, if something replaced it)."""
        for i, param in enumerate(self.params):
            if param.grad is None or param.grad.data_ptr() != self.grad_view(i).data_ptr():
                param.grad = self.grad_view(i)


def plan_buckets(params: list[nn.Parameter], *, cap_bytes: int,
                 key: Callable[[nn.Parameter], Hashable] = lambda p: None) -> list[list[nn.Parameter]]:
    """Group trainable params (reversed) into lists of about cap_bytes, one (key, dtype, device) each.

    The assignment depends only on the parameter list, so every rank with the same model plans the
    same buckets, in the same order: that is what lets them launch collectives in the same order.
    """
    planned: list[list[nn.Parameter]] = []
    pending: dict[Hashable, list[nn.Parameter]] = {}
    filled: dict[Hashable, int] = {}  # bytes of each pending group
    for param in reversed([p for p in params if p.requires_grad]):
        group_key = (key(param), param.dtype, param.device)
        pending.setdefault(group_key, []).append(param)
        filled[group_key] = filled.get(group_key, 0) + param.numel() * param.element_size()
        if filled[group_key] >= cap_bytes:
            planned.append(pending.pop(group_key))
            del filled[group_key]
    planned.extend(pending.values())
    return planned


def build_buckets(params: list[nn.Parameter], *, cap_bytes: int,
                  key: Callable[[nn.Parameter], Hashable] = lambda p: None, allocate: bool = True) -> list[Bucket]:
    """Buckets of plan_buckets, each with a zeroed buffer that the parameters' .grad now view
    (allocate False: released, until their allocate())."""
    buckets = []
    for index, group in enumerate(plan_buckets(params, cap_bytes=cap_bytes, key=key)):
        offsets, total = [], 0
        for param in group:
            offsets.append(total)
            total += param.numel()
        buffer = torch.zeros(total if allocate else 0, dtype=group[0].dtype, device=group[0].device)
        bucket = Bucket(index=index, params=group, buffer=buffer, offsets=offsets, numel=total)
        if allocate:
            bucket.attach()
        buckets.append(bucket)
    return buckets
