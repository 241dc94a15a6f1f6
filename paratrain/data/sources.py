"""Token sources: where the tokens of a run come from.

Three kinds, one shape: a flat array of token ids for training and another for validation.
- builtin: the English text every CPython ships (pydoc_data.topics), as UTF-8 bytes (vocab 256);
- a text file: its UTF-8 bytes (vocab 256), the tail held out for validation;
- a folder with train.bin and val.bin: uint16 token ids, memory-mapped (nanoGPT's layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256


@dataclass(frozen=True)
class TokenSource:
    name: str
    train: np.ndarray
    """Token ids, 1-D (uint8 for bytes, uint16 for token files; may be a read-only memmap)."""
    val: np.ndarray
    vocab_size: int
    """Smallest vocabulary that holds every id (256 for bytes; max id + 1 bound for token files)."""

    def decode(self, ids: list[int]) -> str:
        if self.vocab_size != BYTE_VOCAB:
            return " ".join(str(i) for i in ids)
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def encode_text(text: str) -> list[int]:
        return list(text.encode("utf-8"))


def builtin_text() -> str:
    """CPython's pydoc topics, in a fixed order (about 460 KB of English technical prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _split(data: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def load_source(source: str, *, val_fraction: float = 0.1) -> TokenSource:
    """Open a source by its config string: 'builtin', a .txt path, or a folder of .bin files."""
    if source == "builtin":
        data = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8)
        train, val = _split(data, val_fraction)
        return TokenSource("builtin", train, val, BYTE_VOCAB)
    path = Path(source)
    if path.is_dir():
        missing = [n for n in ("train.bin", "val.bin") if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"token folder {str(path)!r} lacks {missing}: it needs train.bin and val.bin (uint16)")
        train = np.memmap(path / "train.bin", dtype=np.uint16, mode="r")
        val = np.memmap(path / "val.bin", dtype=np.uint16, mode="r")
        vocab = int(max(train.max(initial=0), val.max(initial=0))) + 1
        return TokenSource(str(path), train, val, vocab)
    if path.is_file():
        data = np.fromfile(path, dtype=np.uint8)
        train, val = _split(data, val_fraction)
        return TokenSource(str(path), train, val, BYTE_VOCAB)
    raise FileNotFoundError(
        f"data source {source!r} is neither 'builtin', a text file, nor a folder with train.bin/val.bin"
    )


def write_token_file(path: str | Path, tokens: np.ndarray) -> None:
    """Write token ids as uint16 (the layout load_source reads)."""
    if len(tokens) and int(np.max(tokens)) >= 2**16:
        raise ValueError(f"token id {int(np.max(tokens))} does not fit uint16")
    np.asarray(tokens, dtype=np.uint16).tofile(path)
