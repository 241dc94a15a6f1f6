"""Iterable datasets read layout-free: StreamLoader (a stream in its own order), and dataset_loader, which picks it or
paratrain.data.loader.DatasetLoader (a map-style dataset shuffled by the seed) for a dataset."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Union

import torch
from torch.utils.data import default_collate

from paratrain.data.loader import DatasetLoader, MapDataset

Data = Union[MapDataset, Iterable[Any]]
"""A map-style dataset (len() and [i]) or an iterable one."""


class StreamLoader:
    """An iterable dataset (torch.utils.data.IterableDataset, a generator-backed object: anything with __iter__ and no
    __getitem__) read in its own order, layout-free: global batch k is the stream's items [k G, (k + 1) G) whatever
    dp, and every rank iterates the stream and keeps its rows of each (rank r: rows [r G / dp, (r + 1) G / dp)).
    When the stream ends it is iterated again (the next epoch); an epoch's tail of fewer than G items is skipped.

    The resume rule: the state is the number of items consumed, and a resumed run iterates the stream afresh and
    skips that many, so the dataset must yield the same items in the same order each time it is iterated (a
    shuffling stream must seed its shuffle itself, by epoch). Items are stacked by default_collate."""

    def __init__(self, dataset: Iterable[Any], *, global_batch: int, dp: int, dp_index: int) -> None:
        if global_batch % dp:
            raise ValueError(f"global_batch ({global_batch}) must be divisible by dp ({dp})")
        self.dataset, self.global_batch, self.dp, self.dp_index = dataset, global_batch, dp, dp_index
        self.consumed = 0
        self._items: Iterator[Any] = iter(dataset)
        self._epoch_items = 0
        self._per_epoch: int | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Whole global batches in one pass of the stream (counted by iterating it once, when first asked)."""
        if self._per_epoch is None:
            self._per_epoch = sum(1 for _ in self.dataset)
        return self._per_epoch // self.global_batch

    def _take(self) -> list[Any]:
        """The stream's next G items, starting it again when it ends."""
        batch: list[Any] = []
        restarted = False
        while len(batch) < self.global_batch:
            try:
                batch.append(next(self._items))
                self._epoch_items += 1
            except StopIteration:
                if restarted or self._epoch_items < self.global_batch:
                    raise ValueError(f"the stream ({type(self.dataset).__name__}) yields "
                                     f"{self._epoch_items if not restarted else len(batch)} items in a pass, fewer "
                                     f"than one global batch ({self.global_batch})") from None
                self._items, self._epoch_items, batch, restarted = iter(self.dataset), 0, [], True
        self.consumed += self.global_batch
        return batch

    def next(self) -> Any:
        """This rank's rows of the next global batch, stacked by default_collate."""
        per_rank = self.global_batch // self.dp
        return default_collate(self._take()[self.dp_index * per_rank: (self.dp_index + 1) * per_rank])

    def rewind(self) -> None:
        self._items, self._epoch_items, self.consumed = iter(self.dataset), 0, 0

    def log_fields(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "global_batch": self.global_batch, "stream": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not state.get("stream") or state.get("global_batch") != self.global_batch:
            raise ValueError(f"the checkpoint's loader ({state}) is not a stream of global batch {self.global_batch}: "
                             "resume a streamed run with the same dataset kind and global batch")
        self.rewind()
        for _ in range(int(state["consumed"]) // self.global_batch):
            self._take()


def is_stream(data: Data) -> bool:
    """An iterable dataset (no [i]): read in its own order."""
    return isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__getitem__")


def dataset_loader(data: Data, *, global_batch: int, dp: int, dp_index: int, seed: int,
                   shuffle: bool = True) -> DatasetLoader | StreamLoader:
    """The layout-free loader of a map-style dataset (shuffled by the seed) or of a stream (its own order)."""
    if is_stream(data):
        return StreamLoader(data, global_batch=global_batch, dp=dp, dp_index=dp_index)  # type: ignore[arg-type]
    return DatasetLoader(data, global_batch=global_batch, dp=dp, dp_index=dp_index,  # type: ignore[arg-type]
                         seed=seed, shuffle=shuffle)
