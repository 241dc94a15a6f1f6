"""How many bytes of activations autograd keeps for backward: the memory that tensor-parallel
splitting, sequence parallelism and recomputation save (Korthikanti et al. 2022 count the same)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

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
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield record


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage is not a real one); any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
