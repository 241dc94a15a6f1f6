"""A rank's share of the global batch, cut into micro-batches and moved to the device.

A batch is a tensor, a sequence of tensors (inputs, targets) or a mapping of them, every tensor with
the same number of rows (dim 0)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

import torch

Batch = Union[torch.Tensor, Sequence[torch.Tensor], Mapping[str, torch.Tensor]]


def split_batch(batch: Batch, micro_batch: int) -> list[Any]:
    """Cut every tensor of `batch` along dim 0 into pieces of `micro_batch` rows."""
    rows = batch_rows(batch)
    if rows % micro_batch:
        raise ValueError(f"this rank's batch has {rows} rows, not a multiple of micro_batch={micro_batch}")
    starts = range(0, rows, micro_batch)
    if isinstance(batch, torch.Tensor):
        return [batch[s: s + micro_batch] for s in starts]
    if isinstance(batch, Mapping):
        return [{k: v[s: s + micro_batch] for k, v in batch.items()} for s in starts]
    return [type(batch)(t[s: s + micro_batch] for t in batch) for s in starts]  # type: ignore[call-arg]


def batch_rows(batch: Batch) -> int:
    """The rows (samples) of a batch; every tensor of it must have as many."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    tensors = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of a batch must have the same number of rows, got {sorted(sizes)}")
    return sizes.pop()


def to_device(batch: Batch, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return type(batch)(t.to(device, non_blocking=True) for t in batch)  # type: ignore[call-arg]
