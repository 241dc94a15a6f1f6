"""Token sources: where the tokens of a run come from.

Four kinds, one shape: a flat array of token ids for training and another for validation.
- builtin: the English text every CPython ships (pydoc_data.topics), as UTF-8 bytes (vocab 256);
- a text file: its UTF-8 bytes (vocab 256), the tail held out for validation;
- a folder with train.bin / train.idx and val.bin / val.idx: Megatron's indexed layout, as `paratrain
  tokenize` writes it (paratrain.data.indexed; its tokens.json names the tokenizer), memory-mapped;
- a folder with train.bin and val.bin alone: uint16 token ids, memory-mapped (nanoGPT's layout);
- a Megatron prefix (PREFIX.bin + PREFIX.idx), split into train / validation at run time as megatron-core splits
  it (paratrain.data.corpora);
- a folder of many shards (PREFIX.bin + PREFIX.idx pairs), read lazily and split as one prefix
  (paratrain.data.shards; text shards are tokenized for --hf first, paratrain.data.text).
A run reads one source, or a weighted mixture of several (open_data; paratrain.data.mixture).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paratrain.data.loader import DocumentStarts, TokenArray
from paratrain.data.mixture import WeightSchedule

BYTE_VOCAB = 256


@dataclass(frozen=True)
class TokenSource:
    name: str
    train: TokenArray
    """Token ids, 1-D (uint8 for bytes, uint16 for token files; may be a read-only memmap, or a folder of shards read
    lazily: paratrain.data.shards.ShardedTokens)."""
    val: TokenArray
    vocab_size: int
    """Smallest vocabulary that holds every id (256 for bytes; max id + 1 bound for token files; the tokenizer's
    for `paratrain tokenize`'s)."""
    tokenizer: dict | None = None
    """`paratrain tokenize`'s record of the tokenizer that wrote the files (tokens.json), else None."""
    train_documents: DocumentStarts | None = None
    """int64: where each document of `train` starts (a document index: Megatron's .idx; read lazily for shards),
    else None."""
    val_documents: DocumentStarts | None = None
    train_mask: np.ndarray | None = None
    """uint8 beside `train`: 1 where a token is a target the loss counts (chat data, paratrain.data.chat), else None."""
    val_mask: np.ndarray | None = None
    order: str = "dense"
    """The epoch permutation's kind (paratrain.data.loader.GlobalOrder): 'keyed' for shards (O(1) memory)."""

    @property
    def can_write(self) -> bool:
        """Whether ids turn back into text: bytes, or the tokenizer `paratrain tokenize` recorded."""
        return self.vocab_size == BYTE_VOCAB or self.tokenizer is not None

    def _tokenizer(self):  # type: ignore[no-untyped-def]
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(self.name) / "tokenizer" / "tokenizer.json"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self._tokenizer().decode(ids)
        if self.vocab_size != BYTE_VOCAB:
            return " ".join(str(i) for i in ids)
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self._tokenizer().encode(text, add_special_tokens=False).ids
        return list(text.encode("utf-8"))


def builtin_text() -> str:
    """CPython's pydoc topics, in a fixed order (about 460 KB of English technical prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _split(data: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def load_source(source: str, *, val_fraction: float = 0.1, split: str = "") -> TokenSource:
    """Open a source by its config string: 'builtin', a .txt path, a folder of .bin files, or a Megatron prefix
    (split by `split`, Megatron's default when '')."""
    from paratrain.data.corpora import is_prefix
    from paratrain.data.shards import is_shard_folder

    if is_shard_folder(source):
        return _shard_source(source, split)
    if split and (source == "builtin" or Path(source).is_dir() or not is_prefix(source)):
        raise FileNotFoundError(f"--split {split} splits a Megatron prefix (PREFIX.bin + PREFIX.idx) or a folder of "
                                f"shards at run time, and {source!r} is neither: drop --split (a folder `paratrain "
                                "tokenize` wrote holds its own train and val)")
    if source == "builtin":
        data = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8)
        train, val = _split(data, val_fraction)
        return TokenSource("builtin", train, val, BYTE_VOCAB)
    path = Path(source)
    if path.is_dir() and (path / "train.idx").is_file():
        return _indexed_source(path)
    if path.is_dir():
        missing = [n for n in ("train.bin", "val.bin") if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"token folder {str(path)!r} lacks {missing}: it needs train.bin and val.bin (uint16)")
        train = np.memmap(path / "train.bin", dtype=np.uint16, mode="r")
        val = np.memmap(path / "val.bin", dtype=np.uint16, mode="r")
        vocab = int(max(train.max(initial=0), val.max(initial=0))) + 1
        return TokenSource(str(path), train, val, vocab)
    if is_prefix(source):
        return _prefix_source(source, split)
    if path.is_file():
        data = np.fromfile(path, dtype=np.uint8)
        train, val = _split(data, val_fraction)
        return TokenSource(str(path), train, val, BYTE_VOCAB)
    raise FileNotFoundError(
        f"data source {source!r} is neither 'builtin', a text file, nor a folder with train.bin/val.bin"
    )


def _indexed_source(path: Path) -> TokenSource:
    """A folder of train / val in Megatron's indexed layout (paratrain tokenize's, or Megatron's own)."""
    import json

    from paratrain.data.indexed import IndexedTokens

    if not (path / "val.idx").is_file():
        raise FileNotFoundError(f"token folder {str(path)!r} has train.idx and no val.idx: it needs both splits")
    train, val = IndexedTokens(path / "train"), IndexedTokens(path / "val")
    meta = json.loads((path / "tokens.json").read_text()) if (path / "tokens.json").is_file() else {}
    tokenizer = meta.get("tokenizer")
    vocab = tokenizer["vocab_size"] if tokenizer else int(max(train.tokens.max(initial=0), val.tokens.max(initial=0))) + 1
    masks = [IndexedTokens(path / f"{split}_mask").tokens if (path / f"{split}_mask.idx").is_file() else None
             for split in ("train", "val")]
    for split, mask, tokens in zip(("train", "val"), masks, (train.tokens, val.tokens)):
        if mask is not None and len(mask) != len(tokens):
            raise ValueError(f"{path}: {split}_mask holds {len(mask)} entries for {len(tokens)} tokens: write the "
                             "folder again with `paratrain tokenize --chat`")
    return TokenSource(str(path), train.tokens, val.tokens, vocab, tokenizer, train.document_starts,
                       val.document_starts, masks[0], masks[1])


def _prefix_source(source: str, split: str) -> TokenSource:
    """A Megatron prefix, split as megatron-core splits it (paratrain.data.corpora)."""
    from paratrain.data.corpora import DEFAULT_SPLIT, prefix_parts

    parts = prefix_parts(source, split or DEFAULT_SPLIT)
    (train, train_starts), (val, val_starts) = parts["train"], parts["val"]
    vocab = int(max(train.max(initial=0), val.max(initial=0))) + 1
    name = source[:-4] if source.endswith((".bin", ".idx")) else source
    return TokenSource(name, train, val, vocab, None, train_starts, val_starts)


def _shard_source(source: str, split: str) -> TokenSource:
    """A folder of shards read lazily (paratrain.data.shards), split as one Megatron prefix; its tokens.json names the
    tokenizer when paratrain tokenized its text."""
    import json

    from paratrain.data.shards import shard_parts

    parts = shard_parts(source, split)
    train, val = parts["train"], parts["val"]
    meta = Path(source, "tokens.json")
    tokenizer = json.loads(meta.read_text()).get("tokenizer") if meta.is_file() else None
    vocab = tokenizer["vocab_size"] if tokenizer else max(train.max_id(), val.max_id()) + 1
    return TokenSource(source, train, val, vocab, tokenizer, train.documents, val.documents, order="keyed")


@dataclass(frozen=True)
class RunData:
    """What a run reads: one source, or a weighted mixture of several (weights: their schedule by step)."""

    sources: tuple[TokenSource, ...]
    weights: WeightSchedule | None = None

    @property
    def first(self) -> TokenSource:
        """The source whose tokenizer decodes samples (a mixture's sources share one: check_data)."""
        return self.sources[0]


def open_data(source: str, *, path: tuple[str, ...] = (), schedule: str = "", val_fraction: float = 0.1,
              split: str = "") -> RunData:
    """The run's data: `path` (weight, source, ... : a mixture, Megatron's --data-path) when given, else `source`."""
    if not path:
        if schedule:
            raise FileNotFoundError(f"--data-schedule {schedule!r} changes a mixture's weights, and there is no "
                                    "mixture: give --data-path W1 SOURCE1 W2 SOURCE2 ...")
        return RunData((load_source(source, val_fraction=val_fraction, split=split),))
    if len(path) % 2:
        raise FileNotFoundError(f"--data-path takes weight, source pairs (Megatron's spelling: 0.3 A 0.7 B), got "
                                f"{len(path)} items: {list(path)}")
    try:
        weights = [float(w) for w in path[0::2]]
    except ValueError:
        raise FileNotFoundError(f"--data-path takes weight, source pairs (0.3 A 0.7 B): {list(path[0::2])} are not all "
                                "numbers") from None
    names = [str(p) for p in path[1::2]]
    sources = tuple(load_source(name, val_fraction=val_fraction, split=split) for name in names)
    plan = (WeightSchedule.parse(schedule, len(sources)) if schedule
            else WeightSchedule.of([(0, weights)], len(sources)))
    return RunData(sources, plan)


def write_token_file(path: str | Path, tokens: np.ndarray) -> None:
    """Write token ids as uint16 (the layout load_source reads)."""
    if len(tokens) and int(np.max(tokens)) >= 2**16:
        raise ValueError(f"token id {int(np.max(tokens))} does not fit uint16")
    np.asarray(tokens, dtype=np.uint16).tofile(path)
