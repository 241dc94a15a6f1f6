"""The global-batch loader: a layout-free sample order, each dp rank reading its slice.

Samples are windows of seq_len + 1 tokens, sample i = tokens[i * S : i * S + S + 1] (input the first
S, target the last S). Each epoch visits the samples in a permutation seeded by (seed, epoch) only.
Global batch b of an epoch is the G samples perm[b * G : (b + 1) * G]; dp rank r reads rows
[r * G / dp, (r + 1) * G / dp) of it. So the set of samples in every optimizer step is the same for
any dp degree and micro-batch size; only who computes which row changes. An epoch's tail of fewer
than G samples is skipped (as drop_last), the same way in every layout.

State is (epoch, cursor): saved with a checkpoint, it makes a resumed run read exactly the batches
an uninterrupted run would have read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratrain.rng import keyed_generator


@dataclass
class LoaderState:
    epoch: int = 0
    cursor: int = 0
    """Samples of this epoch's permutation already handed out (a multiple of global_batch)."""


class GlobalBatchLoader:
    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, dp: int, dp_index: int,
                 seed: int, shuffle: bool = True) -> None:
        if global_batch % dp:
            raise ValueError(f"global_batch ({global_batch}) must be divisible by dp ({dp})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp, self.dp_index = dp, dp_index
        self.seed = seed
        self.shuffle = shuffle
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < global_batch:
            raise ValueError(
                f"the data holds {self.num_samples} samples of {seq_len + 1} tokens, fewer than one "
                f"global batch ({global_batch}): use more data, a shorter seq_len or a smaller global batch"
            )
        self.state = LoaderState()
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self.last_indices: list[int] = []
        """Global sample indices of this rank's rows in the last batch (for tests and debugging)."""

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = torch.randperm(self.num_samples, generator=keyed_generator(self.seed, f"data/epoch{epoch}"))
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def global_indices(self) -> list[int]:
        """The sample indices of the next whole global batch (what every rank together reads)."""
        order = self._epoch_order(self.state.epoch)
        return order[self.state.cursor: self.state.cursor + self.global_batch].tolist()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch: inputs[G/dp, S] and targets[G/dp, S], int64."""
        indices = self.global_indices()
        per_rank = self.global_batch // self.dp
        mine = indices[self.dp_index * per_rank: (self.dp_index + 1) * per_rank]
        self.state.cursor += self.global_batch
        if self.state.cursor + self.global_batch > self.num_samples:
            self.state = LoaderState(epoch=self.state.epoch + 1, cursor=0)
        self.last_indices = mine
        return self.gather(mine)

    def gather(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        # rows[n, S + 1]: sample windows, read straight from the (possibly memory-mapped) array
        rows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int64) for s in starts])
        data = torch.from_numpy(rows)
        return data[:, :-1], data[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "cursor": self.state.cursor, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("global_batch", "seq_len", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's loader has {key}={state[key]}, this run {key}={getattr(self, key)}: "
                    "a resumed run must keep the global batch, sequence length and seed to read the same samples"
                )
        self.state = LoaderState(epoch=int(state["epoch"]), cursor=int(state["cursor"]))
