"""The global-batch loaders: a layout-free sample order, each dp rank reading its slice.

GlobalOrder is the order: each epoch visits sample indices 0 .. N-1 in a permutation seeded by
(seed, epoch) only. Global batch b of an epoch is the G samples perm[b * G : (b + 1) * G]; dp rank
r reads rows [r * G / dp, (r + 1) * G / dp) of it. So the set of samples in every optimizer step is
the same for any dp degree and micro-batch size; only who computes which row changes. An epoch's
tail of fewer than G samples is skipped (as drop_last), the same way in every layout. Its state is
(epoch, cursor): saved with a checkpoint, it makes a resumed run read exactly the batches an
uninterrupted run would have read.

An epoch's permutation is torch.randperm (order "dense", 8 bytes a sample), or for a streaming source a
KeyedPermutation computed position by position in O(1) memory (order "keyed"; paratrain.data.permutation).

Two loaders read samples in that order:
- GlobalBatchLoader: windows of seq_len + 1 tokens of a flat token array, sample i =
  tokens[i * S : i * S + S + 1] (input the first S, target the last S); given the corpus's document
  starts, also each token's position in its document (paratrain.nn.documents), and no target where the
  next token starts another document;
- DatasetLoader: the items of any map-style dataset (len() and [i]), stacked by torch's
  default_collate (tensors, numbers, and tuples or dicts of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np
import torch
from torch.utils.data import default_collate

from paratrain.config.plan import BatchRampup, SeqWarmup
from paratrain.data.permutation import KeyedPermutation
from paratrain.rng import keyed_generator

ORDERS = ("dense", "keyed")


class TokenArray(Protocol):
    """Token ids read by window: a numpy array (or memmap), or a streaming source's view (ShardedTokens)."""

    dtype: np.dtype

    def __len__(self) -> int: ...
    def __getitem__(self, window: slice) -> np.ndarray: ...


class LazyStarts(Protocol):
    """Where documents begin, read when a window needs them (paratrain.data.shards.ShardDocuments)."""

    def between(self, lo: int, hi: int) -> np.ndarray: ...


DocumentStarts = Union[np.ndarray, LazyStarts]
"""Increasing token offsets where documents begin: an array, or read lazily."""


@dataclass
class LoaderState:
    epoch: int = 0
    cursor: int = 0
    """Samples of this epoch's permutation already handed out."""
    consumed: int = 0
    """Samples handed out since the first step, over every epoch (what a batch-size ramp-up reads)."""
    step: int = 0
    """Global batches handed out since the first step (what a sequence warm-up reads)."""


class GlobalOrder:
    """Which sample indices each dp rank reads at each step (see the module docstring)."""

    def __init__(self, num_samples: int, *, global_batch: int, dp: int, dp_index: int, seed: int,
                 shuffle: bool = True, rampup: BatchRampup | None = None, order: str = "dense") -> None:
        """rampup: the global batch grows from rampup.start to global_batch (BatchRampup); None: fixed.
        order: 'dense' (torch.randperm per epoch) or 'keyed' (KeyedPermutation: O(1) memory, streaming sources)."""
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.order = order
        for size in rampup.sizes() if rampup is not None else [global_batch]:
            if size % dp:
                raise ValueError(f"global_batch ({size}) must be divisible by dp ({dp})")
        if rampup is not None and rampup.target != global_batch:
            raise ValueError(f"the ramp-up's target ({rampup.target}) must be the global batch ({global_batch})")
        self.rampup = rampup
        if num_samples < global_batch:
            raise ValueError(f"{self.describe()} holds {num_samples} samples, fewer than one global batch ({global_batch}): "
                             "use more data or a smaller global batch")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp, self.dp_index = dp, dp_index
        self.seed = seed
        self.shuffle = shuffle
        self.state = LoaderState()
        self._order: torch.Tensor | KeyedPermutation | None = None
        self._order_epoch = -1
        self.last_indices: list[int] = []
        """Global sample indices of this rank's rows in the last batch (for tests and debugging)."""
        self.last_batch = 0
        """Samples of the last global batch, all ranks together."""

    def describe(self) -> str:
        """What the samples are, for messages (a subclass names its source)."""
        return "the data"

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def _epoch_order(self, epoch: int) -> torch.Tensor | KeyedPermutation:
        if self._order_epoch != epoch:
            if self.shuffle and self.order == "keyed":
                self._order = KeyedPermutation(self.num_samples, seed=self.seed, key=f"data/epoch{epoch}")
            elif self.shuffle:
                self._order = torch.randperm(self.num_samples, generator=keyed_generator(self.seed, f"data/epoch{epoch}"))
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    @property
    def batch_size(self) -> int:
        """The next step's global batch (global_batch, or the ramp-up's size at this point)."""
        return self.global_batch if self.rampup is None else self.rampup.batch_at(self.state.consumed)

    def global_indices(self) -> list[int]:
        """The sample indices of the next whole global batch (what every rank together reads)."""
        order = self._epoch_order(self.state.epoch)
        if isinstance(order, KeyedPermutation):
            return order.at(np.arange(self.state.cursor, self.state.cursor + self.batch_size)).tolist()
        return order[self.state.cursor: self.state.cursor + self.batch_size].tolist()

    def next_indices(self) -> list[int]:
        """This rank's sample indices of the next global batch; moves the cursor on."""
        indices = self.global_indices()
        per_rank = len(indices) // self.dp
        mine = indices[self.dp_index * per_rank: (self.dp_index + 1) * per_rank]
        self.state.cursor += len(indices)
        self.state.consumed += len(indices)
        self.state.step += 1
        if self.state.cursor + self.batch_size > self.num_samples:
            self.state = LoaderState(epoch=self.state.epoch + 1, cursor=0, consumed=self.state.consumed,
                                     step=self.state.step)
        self.last_indices = mine
        self.last_batch = len(indices)
        return mine

    def rewind(self) -> None:
        """Back to the first batch of epoch 0 (validation reads the same batches every time)."""
        self.state = LoaderState()

    def log_fields(self) -> dict[str, Any]:
        """What a step's log record says of the data (one source: the last step's global batch under a ramp-up)."""
        return {} if self.rampup is None else {"global_batch": self.last_batch}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.state.epoch, "cursor": self.state.cursor,
                                 "global_batch": self.global_batch, "seed": self.seed, "consumed": self.state.consumed,
                                 "step": self.state.step, "order": self.order}
        if self.rampup is not None:
            state["rampup"] = [self.rampup.start, self.rampup.increment, self.rampup.samples]
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "draws" in state:
            raise ValueError("the checkpoint's loader mixed several sources (--data-path), and this run reads one: "
                             "resume with the mixture it was trained on")
        for key in ("global_batch", "seed", "order"):
            saved = state.get(key, "dense" if key == "order" else None)  # (checkpoints before keyed orders: dense)
            if saved not in (None, getattr(self, key)):
                raise ValueError(
                    f"the checkpoint's loader has {key}={saved}, this run {key}={getattr(self, key)}: "
                    "a resumed run must keep the global batch, seed and kind of source (a streaming folder reads in "
                    "a keyed order) to read the same samples"
                )
        ramp = [self.rampup.start, self.rampup.increment, self.rampup.samples] if self.rampup is not None else None
        if "consumed" in state and list(state.get("rampup") or []) != list(ramp or []):
            raise ValueError(f"the checkpoint's loader ramped the batch up as {state.get('rampup')}, this run as "
                             f"{ramp}: a resumed run must keep the ramp-up to read the same samples per step")
        self.state = LoaderState(epoch=int(state["epoch"]), cursor=int(state["cursor"]),
                                 consumed=int(state.get("consumed", 0)), step=int(state.get("step", 0)))


class GlobalBatchLoader(GlobalOrder):
    def __init__(self, tokens: TokenArray, *, seq_len: int, global_batch: int, dp: int, dp_index: int,
                 seed: int, shuffle: bool = True, document_starts: DocumentStarts | None = None,
                 rampup: BatchRampup | None = None, loss_mask: np.ndarray | None = None,
                 warmup: SeqWarmup | None = None, order: str = "dense") -> None:
        """document_starts: increasing token offsets where documents start (IndexedTokens.document_starts):
        batches are then (inputs, targets, positions) of packed documents (paratrain.nn.documents).
        rampup: the global batch grows to global_batch (BatchRampup).
        loss_mask: beside `tokens`, 1 where a token is a target the loss counts (chat data): targets at 0 become
        -100.
        warmup: a sequence-length warm-up (SeqWarmup): early steps' samples cut into shorter sequences.
        order: the epoch permutation's kind (GlobalOrder): 'keyed' for a streaming source."""
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.warmup = warmup
        self.seq_len = seq_len
        self.document_starts = (np.asarray(document_starts, dtype=np.int64) if isinstance(document_starts, np.ndarray)
                                else document_starts)
        super().__init__((len(tokens) - 1) // seq_len, global_batch=global_batch, dp=dp, dp_index=dp_index,
                         seed=seed, shuffle=shuffle, rampup=rampup, order=order)

    def describe(self) -> str:
        return f"the data (in samples of {self.seq_len + 1} tokens)"

    def next(self) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the next global batch: inputs[G/dp, S] and targets[G/dp, S], int64 (and
        positions[G/dp, S] with document starts); under a sequence warm-up [G/dp x S/L, L]."""
        length = self.seq_len if self.warmup is None else self.warmup.length_at(self.state.step)
        return self.gather(self.next_indices(), length)

    def gather(self, indices: list[int], length: int | None = None) -> tuple[torch.Tensor, ...]:
        """The samples' rows; `length` < seq_len: each cut into seq_len / length sequences of `length` tokens (the
        same targets; positions restart in each)."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        if length is not None and length < self.seq_len:
            pieces = self.seq_len // length
            inputs, targets, *_ = self.gather(indices)
            shape = (len(indices) * pieces, length)
            if self.document_starts is None:
                return inputs.reshape(shape), targets.reshape(shape)
            cut = (starts[:, None] + np.arange(pieces, dtype=np.int64)[None, :] * length).reshape(-1)
            positions, _ = document_positions(cut, length, self.document_starts)
            return inputs.reshape(shape), targets.reshape(shape), torch.from_numpy(positions)
        # rows[n, S + 1]: sample windows, read straight from the (possibly memory-mapped) array
        rows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int64) for s in starts])
        data = torch.from_numpy(rows)
        targets = data[:, 1:]
        if self.loss_mask is not None:  # chat data: only the assistant's tokens are targets
            kept = np.stack([np.asarray(self.loss_mask[s + 1: s + self.seq_len + 1], dtype=bool) for s in starts])
            targets = targets.masked_fill(torch.from_numpy(~kept), -100)
        if self.document_starts is None:
            return data[:, :-1], targets
        positions, crossing = document_positions(starts, self.seq_len, self.document_starts)
        return data[:, :-1], targets.masked_fill(torch.from_numpy(crossing), -100), torch.from_numpy(positions)

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "seq_len" in state and state["seq_len"] != self.seq_len:
            raise ValueError(
                f"the checkpoint's loader has seq_len={state['seq_len']}, this run seq_len={self.seq_len}: "
                "a resumed run must keep the global batch, sequence length and seed to read the same samples"
            )
        super().load_state_dict(state)


def document_positions(window_starts: np.ndarray, seq_len: int,
                       document_starts: DocumentStarts) -> tuple[np.ndarray, np.ndarray]:
    """For windows of seq_len input tokens starting at these offsets of the token stream: each input token's
    position in its document, counted from the window's start for the document that began before it
    (int64[n, S]), and where its target is the first token of another document (bool[n, S]: no loss there,
    nothing in the window's own document predicts it)."""
    if not isinstance(document_starts, np.ndarray):  # read lazily: each window with the starts inside it
        positions = np.empty((len(window_starts), seq_len), dtype=np.int64)
        crossing = np.empty((len(window_starts), seq_len), dtype=bool)
        zero = np.zeros(1, dtype=np.int64)
        for row, start in enumerate(np.asarray(window_starts, dtype=np.int64).tolist()):
            inside = document_starts.between(start, start + seq_len + 1) - start
            positions[row], crossing[row] = (part[0] for part in document_positions(zero, seq_len, inside))
        return positions, crossing
    flat = window_starts[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]  # [n, S]: each input's offset
    if len(document_starts) == 0:  # no document index entries: one document, from each window's start
        return flat - window_starts[:, None], np.zeros(flat.shape, dtype=bool)
    holder = np.searchsorted(document_starts, flat, side="right") - 1  # the document each token belongs to
    begins = np.where(holder >= 0, document_starts[np.maximum(holder, 0)], 0)
    positions = flat - np.maximum(begins, window_starts[:, None])
    following = np.searchsorted(document_starts, flat + 1)
    crossing = (following < len(document_starts)) & (
        document_starts[np.minimum(following, len(document_starts) - 1)] == flat + 1)
    return positions, crossing


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


class DatasetLoader(GlobalOrder):
    def __init__(self, dataset: MapDataset, *, global_batch: int, dp: int, dp_index: int, seed: int,
                 shuffle: bool = True) -> None:
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"a dataset must be map-style (len() and [index]), got {type(dataset).__name__}: "
                            "wrap an iterable in a list, or give a torch.utils.data.TensorDataset")
        self.dataset = dataset
        super().__init__(len(dataset), global_batch=global_batch, dp=dp, dp_index=dp_index, seed=seed,
                         shuffle=shuffle)

    def describe(self) -> str:
        return f"the dataset ({type(self.dataset).__name__})"

    def next(self) -> Any:
        """This rank's rows of the next global batch, its items stacked by default_collate."""
        return default_collate([self.dataset[i] for i in self.next_indices()])
