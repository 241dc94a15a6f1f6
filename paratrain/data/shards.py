"""Streaming sources: a folder of many shards, read lazily with memory that does not grow with the corpus.

    paratrain train --data shards/ --split 98,2,0                   shard_00000.bin/.idx, shard_00001.bin/.idx, ...
    paratrain train --hf ./my-llama --data web/ --data-workers 8    web/part-000.jsonl ... (or .parquet)

A shard folder holds Megatron indexed pairs (any PREFIX.bin + PREFIX.idx, as preprocess_data.py writes one per input
file), or .jsonl / .parquet text files, which a run with `--hf` tokenizes with the model's tokenizer first
(paratrain.data.text.tokenized_shards: each shard on its own, by `--data-workers` processes, cached). The shards, in
the order of their names, are one corpus: their tokens back to back (ShardedTokens), split into train / validation /
test by sequence as megatron-core splits one prefix (paratrain.data.corpora, `--split`, default 969,30,1).

What stays in memory is per shard, not per token or sample: each shard's counts (read from its index's 34-byte
header and last entries), and at most OPEN shards memory-mapped at a time (least recently read closed first). The
epoch order is a KeyedPermutation (paratrain.data.permutation), computed position by position, instead of
torch.randperm's 8 bytes a sample. Document starts are read from the open shards' indexes when a window needs them.
So reading a batch costs the batch (and the pages it touches), whatever the corpus size
(tests/unit/test_shards.py measures it at two sizes 10x apart).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.config.errors import ConfigError
from paratrain.data.indexed import IndexedTokens

OPEN = 16
"""Shards memory-mapped at once (4 maps each: .bin and the index's three arrays)."""
TEXT_SHARDS = (".jsonl", ".parquet")
SAMPLE_BYTES = 1 << 16
"""Bytes of each shard's .bin head and tail that its identity hashes."""


def index_prefixes(folder: Path) -> list[Path]:
    """The indexed shards of a folder (every PREFIX with PREFIX.idx), in name order."""
    return sorted(path.with_suffix("") for path in folder.glob("*.idx"))


def text_shards(folder: Path) -> list[Path]:
    """The text shards of a folder (.jsonl and .parquet files), in name order."""
    return sorted(path for path in folder.iterdir() if path.suffix.lower() in TEXT_SHARDS and path.is_file())


def is_shard_folder(source: str) -> bool:
    """A folder of shards: indexed pairs or text files, and not `paratrain tokenize`'s train/val folder."""
    path = Path(source)
    return (path.is_dir() and not (path / "train.idx").is_file() and not (path / "train.bin").is_file()
            and bool(index_prefixes(path) or text_shards(path)))


@dataclass(frozen=True)
class ShardHeader:
    """What a shard costs to keep: its counts, from the index's header and its last entries."""

    prefix: Path
    dtype: np.dtype
    sequences: int
    tokens: int

    @classmethod
    def read(cls, prefix: Path) -> ShardHeader:
        if not prefix.with_suffix(".bin").is_file():
            raise ConfigError(f"shard {str(prefix)!r} has an .idx and no .bin: every shard is a PREFIX.bin + "
                              "PREFIX.idx pair; write it again or move the .idx away")
        shard = IndexedTokens(prefix)
        return cls(prefix, shard.dtype, len(shard.lengths), len(shard.tokens))


class ShardedTokens:
    """Tokens [start, stop) of shards back to back, as a read-only array: len(), [a:b] (a numpy copy), dtype; and
    `documents` (ShardDocuments) where documents begin. Shards are opened when read, OPEN at a time."""

    def __init__(self, headers: list[ShardHeader], start: int, stop: int) -> None:
        self.headers = headers
        self.offsets = np.concatenate([[0], np.cumsum([h.tokens for h in headers], dtype=np.int64)])
        self.start, self.stop = start, stop
        dtypes = {h.dtype for h in headers}
        if len(dtypes) != 1:
            raise ConfigError(f"the shards of {str(headers[0].prefix.parent)!r} hold ids of several dtypes "
                              f"({sorted(map(str, dtypes))}): write them with one tokenizer and dtype")
        self.dtype = dtypes.pop()
        self._open: OrderedDict[int, IndexedTokens] = OrderedDict()
        self._identity: dict | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def _shard(self, j: int) -> IndexedTokens:
        """Shard j memory-mapped, the least recently read one closed past OPEN."""
        if j in self._open:
            self._open.move_to_end(j)
        else:
            self._open[j] = IndexedTokens(self.headers[j].prefix)
            if len(self._open) > OPEN:
                self._open.popitem(last=False)
        return self._open[j]

    def _shards_of(self, lo: int, hi: int) -> range:
        """The shards holding absolute tokens [lo, hi)."""
        first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        last = int(np.searchsorted(self.offsets, hi, side="left"))
        return range(max(first, 0), min(last, len(self.headers)))

    def __getitem__(self, window: slice) -> np.ndarray:
        if not isinstance(window, slice) or window.step not in (None, 1):
            raise TypeError("ShardedTokens reads contiguous windows: tokens[a:b]")
        a, b, _ = window.indices(len(self))
        lo, hi = self.start + a, self.start + max(a, b)
        parts = []
        for j in self._shards_of(lo, hi):
            base = int(self.offsets[j])
            tokens = self._shard(j).tokens
            parts.append(np.asarray(tokens[max(lo - base, 0): min(hi - base, len(tokens))]))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def document_starts_between(self, lo: int, hi: int) -> np.ndarray:
        """int64: where documents begin in [lo, hi) of this view (its coordinates), found by binary search in the
        shards' memory-mapped indexes (the sequences starting there, those that start a document)."""
        found = []
        for j in self._shards_of(self.start + lo, self.start + hi):
            shard, base = self._shard(j), int(self.offsets[j]) - self.start
            size = shard.dtype.itemsize
            first, end = np.searchsorted(shard.pointers, [(lo - base) * size, (hi - base) * size], side="left")
            documents = shard.document_index[:-1]  # each document's first sequence (increasing)
            d0, d1 = np.searchsorted(documents, [first, end], side="left")
            found.append(np.asarray(shard.pointers[documents[d0:d1]], dtype=np.int64) // size + base)
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    @property
    def documents(self) -> ShardDocuments:
        return ShardDocuments(self)

    def max_id(self) -> int:
        """The largest id of this view, read from the files 64 Ki ids at a time (memory bounded, nothing mapped)."""
        top, chunk = 0, 1 << 16
        for j in self._shards_of(self.start, self.stop):
            base, header = int(self.offsets[j]), self.headers[j]
            lo, hi = max(self.start - base, 0), min(self.stop - base, header.tokens)
            for at in range(lo, hi, chunk):
                ids = np.fromfile(header.prefix.with_suffix(".bin"), dtype=self.dtype, count=min(chunk, hi - at),
                                  offset=at * self.dtype.itemsize)
                top = max(top, int(np.max(ids, initial=0)))
        return top

    def identity(self) -> dict:
        """What names this part's content: its shards' names and token counts, the SHA-256 of each shard's index and
        of its .bin's first and last SAMPLE_BYTES (computed once)."""
        if self._identity is None:
            digest = hashlib.sha256()
            for header in self.headers:
                digest.update(json.dumps([header.prefix.name, header.tokens]).encode())
                digest.update(file_digest(header.prefix.with_suffix(".idx")))
                with open(header.prefix.with_suffix(".bin"), "rb") as data:
                    digest.update(data.read(SAMPLE_BYTES))
                    data.seek(max(0, header.tokens * header.dtype.itemsize - SAMPLE_BYTES))
                    digest.update(data.read(SAMPLE_BYTES))
            digest.update(f"{self.start}:{self.stop}".encode())
            self._identity = {"shards": len(self.headers), "tokens": len(self), "sha256": digest.hexdigest()}
        return self._identity


@dataclass(frozen=True)
class ShardDocuments:
    """Where a ShardedTokens view's documents begin, read from the open shards when asked (not an array of them)."""

    tokens: ShardedTokens

    def between(self, lo: int, hi: int) -> np.ndarray:
        return self.tokens.document_starts_between(lo, hi)


def file_digest(path: Path) -> bytes:
    """The SHA-256 of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def shard_parts(folder: str, split: str) -> dict[str, ShardedTokens]:
    """{"train": ..., "val": ...} of a folder of indexed shards, split by sequence as megatron-core splits one prefix
    (paratrain.data.corpora.split_bounds); a split that leaves a part empty refused by name."""
    from paratrain.data.corpora import DEFAULT_SPLIT, parse_split, split_bounds

    path = Path(folder)
    prefixes = index_prefixes(path)
    if not prefixes:
        texts = [p.name for p in text_shards(path)][:3]
        raise ConfigError(f"the shard folder {folder!r} holds text ({texts}...) and no token shards: text shards are "
                          "tokenized with the model's tokenizer, so give --hf DIR (or tokenize them with "
                          "`paratrain tokenize`)")
    if text_shards(path):
        raise ConfigError(f"the shard folder {folder!r} holds token shards ({prefixes[0].name}.bin/.idx, ...) and text "
                          f"shards ({text_shards(path)[0].name}, ...): which to read is unclear; keep one kind per "
                          "folder")
    headers = [ShardHeader.read(p) for p in prefixes]
    sequence_ends = np.cumsum([h.sequences for h in headers], dtype=np.int64)
    total = int(sequence_ends[-1])
    bounds = split_bounds(parse_split(split or DEFAULT_SPLIT), total)
    view = ShardedTokens(headers, 0, int(sum(h.tokens for h in headers)))

    def token_offset(sequence: int) -> int:
        """The absolute token offset where global sequence `sequence` starts (the end for `total`)."""
        if sequence >= total:
            return int(view.offsets[-1])
        j = int(np.searchsorted(sequence_ends, sequence, side="right"))
        local = sequence - (int(sequence_ends[j - 1]) if j else 0)
        shard = IndexedTokens(headers[j].prefix)
        return int(view.offsets[j]) + int(shard.pointers[local]) // shard.dtype.itemsize

    parts = {}
    for name, (first, end) in (("train", bounds[0]), ("val", bounds[1])):
        if end <= first:
            raise ConfigError(f"--split {split or DEFAULT_SPLIT} leaves the "
                              f"{'validation' if name == 'val' else 'training'} part of the shards in {folder!r} empty "
                              f"({total} sequences in {len(headers)} shards, parts {bounds}): give it a share, e.g. "
                              "--split 98,2,0, or add documents")
        parts[name] = ShardedTokens(headers, token_offset(first), token_offset(end))
    return parts

