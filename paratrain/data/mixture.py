"""Weighted mixtures of token sources, their weights changing by step, in a layout-free order.

    paratrain train --data-path 0.3 A 0.7 B                           Megatron's spelling (weights normalised)
    paratrain train --data-path 0.3 A 0.7 B --data-schedule "0:0.3,0.7;8000:0.6,0.4"   an anneal from step 8000

Global sample k of the run (step k // G, row k % G of the global batch) comes from source

    s(k) = the first source whose cumulative weight exceeds u(seed, k)

with u a uniform keyed by (seed, k) alone (paratrain.rng.hashed_uniform) and the weights in force at step k // G.
Source s's n-th draw reads its n-th sample in its own order (a permutation of its windows keyed by (seed, source,
epoch), as GlobalOrder's): which source and which window each row reads depend on (seed, k, the weights up to
its step) and nothing else, so every dp / tp / pp / cp layout reads the same global batches, dp rank r taking rows
[r G / dp, (r + 1) G / dp). A weight change from step t on changes no draw before step t.

The cursor is (step, draws per source): a checkpoint keeps it with each source's identity (its name, token count
and the SHA-256 of its index or of its first and last MiB), so a resume reads the batches an uninterrupted run
would, under any layout and with new weights from the resumed step on; a changed source is refused by name.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from paratrain.config.errors import ConfigError
from paratrain.data.loader import DocumentStarts, TokenArray, document_positions
from paratrain.data.permutation import KeyedPermutation
from paratrain.data.shards import ShardedTokens
from paratrain.rng import hashed_uniform, keyed_generator, keyed_seed


@dataclass(frozen=True)
class WeightSchedule:
    """The mixture's weights by step: (first step, weights) points, the first at step 0, steps increasing,
    each weights vector normalised to sum to 1."""

    points: tuple[tuple[int, tuple[float, ...]], ...]

    @classmethod
    def of(cls, points: Sequence[tuple[int, Sequence[float]]], sources: int) -> WeightSchedule:
        """Checked and normalised; refused with the rule otherwise."""
        if not points or points[0][0] != 0:
            raise ConfigError(f"a data schedule starts at step 0, got steps {[p[0] for p in points]}: "
                              "e.g. '0:0.7,0.3;8000:0.4,0.6'")
        steps = [step for step, _ in points]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"the data schedule's steps must increase, got {steps}")
        out = []
        for step, weights in points:
            out.append((int(step), normalised(weights, sources, where=f"at step {step}")))
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str, sources: int) -> WeightSchedule:
        """'0:0.7,0.3;8000:0.4,0.6' (`--data-schedule`, or [data] schedule in TOML)."""
        points = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            step, _, weights = part.partition(":")
            try:
                points.append((int(step), [float(w) for w in weights.split(",")]))
            except ValueError:
                raise ConfigError(f"data schedule entry {part!r}: write STEP:W1,W2,... (one weight per source), "
                                  "entries separated by ';', e.g. '0:0.7,0.3;8000:0.4,0.6'") from None
        return cls.of(points, sources)

    def at(self, step: int) -> tuple[float, ...]:
        """The weights in force at `step`."""
        weights = self.points[0][1]
        for first, later in self.points:
            if first > step:
                break
            weights = later
        return weights


def normalised(weights: Sequence[float], sources: int, *, where: str = "") -> tuple[float, ...]:
    """Weights divided by their sum; refused when negative, not finite, not one per source or summing to 0."""
    values = [float(w) for w in weights]
    at = f" {where}" if where else ""
    if len(values) != sources:
        raise ConfigError(f"{len(values)} mixture weights{at} for {sources} sources: give one weight per source")
    if any(not math.isfinite(w) or w < 0 for w in values):
        raise ConfigError(f"mixture weights{at} must be finite and >= 0, got {values}")
    total = sum(values)
    if total <= 0:
        raise ConfigError(f"mixture weights{at} sum to {total}: give at least one positive weight")
    return tuple(w / total for w in values)


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its token stream (possibly a memmap) and where its documents start."""

    name: str
    tokens: TokenArray
    document_starts: DocumentStarts | None = None
    order: str = "dense"
    """Its epoch permutation's kind: 'keyed' (O(1) memory) for a folder of shards (paratrain.data.loader)."""

    def identity(self) -> dict[str, Any]:
        """What names this source's content: its token count and a SHA-256 of its first and last MiB (a folder of
        shards: of its indexes and its shards' heads and tails, ShardedTokens.identity)."""
        if isinstance(self.tokens, ShardedTokens):
            return {"name": self.name, **self.tokens.identity()}
        data = np.asarray(self.tokens).view(np.uint8)
        head, tail = data[: 2**20].tobytes(), data[-(2**20):].tobytes()
        return {"name": self.name, "tokens": int(len(self.tokens)),
                "sha256": hashlib.sha256(head + tail).hexdigest()}


class MixtureLoader:
    """Windows of seq_len + 1 tokens drawn from weighted sources (the module docstring): the Loader protocol of
    paratrain.train.loop (next, rewind, batches_per_epoch, state_dict, load_state_dict) and per-source counts."""

    def __init__(self, sources: Sequence[Source], schedule: WeightSchedule, *, seq_len: int, global_batch: int,
                 dp: int, dp_index: int, seed: int, shuffle: bool = True) -> None:
        if global_batch % dp:
            raise ValueError(f"global_batch ({global_batch}) must be divisible by dp ({dp})")
        if len(schedule.points[0][1]) != len(sources):
            raise ConfigError(f"the data schedule has {len(schedule.points[0][1])} weights, the mixture "
                              f"{len(sources)} sources")
        self.sources, self.schedule = list(sources), schedule
        self.seq_len, self.global_batch, self.dp, self.dp_index = seq_len, global_batch, dp, dp_index
        self.seed, self.shuffle = seed, shuffle
        self.samples = [(len(s.tokens) - 1) // seq_len for s in self.sources]
        for source, samples in zip(self.sources, self.samples):
            if samples < 1:
                raise ConfigError(f"source {source.name!r} holds {len(source.tokens)} tokens, not one sample of "
                                  f"{seq_len + 1}: drop it or lower seq_len")
        self.step = 0
        self.draws = [0] * len(self.sources)
        """Samples drawn from each source so far (the cursor, with `step`)."""
        self._key = keyed_seed(seed, "data/mixture")
        self._orders: dict[tuple[int, int], torch.Tensor | KeyedPermutation] = {}
        self.last_sources: list[int] = []
        """This rank's rows' sources in the last batch (tests, debugging)."""

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.samples) // self.global_batch

    def global_plan(self, step: int, draws: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample in that source) of every row of step `step`'s global batch, given the draws before it."""
        weights = np.asarray(self.schedule.at(step), dtype=np.float64)
        first = step * self.global_batch
        u = hashed_uniform(self._key, torch.arange(first, first + self.global_batch, dtype=torch.int64))
        # the first source whose cumulative weight exceeds u (a zero weight's bound equals the one before it, so
        # it is never the first); a u past the sum's rounding goes to the last source with a weight
        source = np.searchsorted(np.cumsum(weights), u.numpy().astype(np.float64), side="right")
        source = np.minimum(source, int(np.flatnonzero(weights > 0)[-1]))
        nth = np.empty(self.global_batch, dtype=np.int64)
        seen = list(draws)
        for row, s in enumerate(source.tolist()):
            nth[row] = self._sample(s, seen[s])
            seen[s] += 1
        return source, nth

    def _sample(self, source: int, n: int) -> int:
        """Source `source`'s n-th draw: position n of its order, epoch after epoch."""
        size = self.samples[source]
        epoch, position = divmod(n, size)
        if not self.shuffle:
            return position
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.sources):
                self._orders.clear()
            name = f"data/source{source}/epoch{epoch}"
            keyed = self.sources[source].order == "keyed"
            self._orders[key] = (KeyedPermutation(size, seed=self.seed, key=name) if keyed
                                 else torch.randperm(size, generator=keyed_generator(self.seed, name)))
        order = self._orders[key]
        if isinstance(order, KeyedPermutation):
            return int(order.at(np.asarray([position]))[0])
        return int(order[position])

    def next(self) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the next global batch: (inputs, targets), and positions when every source has a
        document index (paratrain.nn.documents)."""
        source, nth = self.global_plan(self.step, self.draws)
        counts = np.bincount(source, minlength=len(self.sources))
        self.draws = [d + int(c) for d, c in zip(self.draws, counts)]
        self.step += 1
        rows = self.global_batch // self.dp
        mine = slice(self.dp_index * rows, (self.dp_index + 1) * rows)
        self.last_sources = source[mine].tolist()
        return self.gather(source[mine], nth[mine])

    def gather(self, source: np.ndarray, nth: np.ndarray) -> tuple[torch.Tensor, ...]:
        starts = nth * self.seq_len
        rows = np.stack([np.asarray(self.sources[s].tokens[b: b + self.seq_len + 1], dtype=np.int64)
                         for s, b in zip(source.tolist(), starts.tolist())])
        data = torch.from_numpy(rows)
        if any(s.document_starts is None for s in self.sources):
            return data[:, :-1], data[:, 1:]
        positions = np.empty((len(starts), self.seq_len), dtype=np.int64)
        crossing = np.empty((len(starts), self.seq_len), dtype=bool)
        for s in set(source.tolist()):
            where = source == s
            documents = self.sources[s].document_starts
            assert documents is not None
            positions[where], crossing[where] = document_positions(starts[where], self.seq_len, documents)
        return data[:, :-1], data[:, 1:].masked_fill(torch.from_numpy(crossing), -100), torch.from_numpy(positions)

    def rewind(self) -> None:
        self.step, self.draws = 0, [0] * len(self.sources)

    def log_fields(self) -> dict[str, Any]:
        """A step's log record: the tokens each source has given so far."""
        return {"source_tokens": self.source_tokens()}

    def source_tokens(self) -> dict[str, int]:
        """Tokens each source has given so far (every rank's rows: the global batches'), by name."""
        return {s.name: d * self.seq_len for s, d in zip(self.sources, self.draws)}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "draws": list(self.draws), "global_batch": self.global_batch, "seed": self.seed,
                "seq_len": self.seq_len, "sources": [s.identity() for s in self.sources],
                "schedule": [[step, list(w)] for step, w in self.schedule.points]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("global_batch", "seed", "seq_len"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the checkpoint's mixture has {key}={state[key]}, this run {key}="
                                 f"{getattr(self, key)}: a resumed run keeps them to read the same samples")
        saved = state.get("sources")
        if saved is None or "draws" not in state:
            raise ValueError("the checkpoint's loader read one source, and this run mixes several: resume with the "
                             "data it was trained on")
        mine = [s.identity() for s in self.sources]
        if [s["name"] for s in saved] != [s["name"] for s in mine]:
            raise ValueError(f"the checkpoint mixed sources {[s['name'] for s in saved]}, this run "
                             f"{[s['name'] for s in mine]}: resume with the same sources in the same order")
        for old, new in zip(saved, mine):
            if old != new:
                raise ValueError(f"source {new['name']!r} changed since the checkpoint ({old['tokens']} tokens, "
                                 f"SHA-256 {old['sha256'][:12]}... then; {new['tokens']}, {new['sha256'][:12]}... "
                                 "now): resume with the data it was trained on")
        self.step, self.draws = int(state["step"]), [int(d) for d in state["draws"]]
