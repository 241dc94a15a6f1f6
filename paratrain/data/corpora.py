"""Megatron-LM corpora as they are: one PREFIX.bin / PREFIX.idx split into train / validation / test at run time.

    paratrain train --data corpus_text_document --split 969,30,1
    paratrain train --data-path 0.3 web_text_document 0.7 books_text_document --split 98,2,0

Megatron's preprocess_data.py writes one prefix per corpus, and megatron-core's BlendedMegatronDatasetBuilder splits
a GPT corpus by sequence (one per document unless sentences were split) at run time: the shares normalised to sum
to 1 (float64), their running sums [0, a, a + b, 1] as book-ends, part i holding sequences
[round(start_i x n), round(end_i x n)) (megatron.core.datasets: parse_and_normalize_split,
convert_split_vector_to_split_matrix and the builder's indexed indices; here in our words, checked against
megatron-core in tests/unit/test_corpora.py). Train reads the first part, validation the second; the test part is
not read by training. Sequences are contiguous in the .bin (written in order), so each part is a slice of the
memory-mapped tokens with its documents' starts (a part may begin inside a document, as Megatron's do).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from paratrain.config.errors import ConfigError

DEFAULT_SPLIT = "969,30,1"
"""Megatron's default --split."""


def parse_split(text: str) -> tuple[float, float, float]:
    """'969,30,1' -> the train, validation and test shares, normalised (missing parts are 0)."""
    try:
        parts = [float(p) for p in text.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--split {text!r}: write the train, validation and test shares separated by commas, "
                          "e.g. 969,30,1 (Megatron's) or 98,2,0") from None
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {text!r}: one to three shares (train, validation, test), finite, >= 0, summing to "
                          "more than 0, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    shares = (np.asarray(parts, dtype=np.float64) / np.sum(np.asarray(parts, dtype=np.float64))).tolist()
    return shares[0], shares[1], shares[2]

def split_bounds(split: Sequence[float], elements: int) -> list[tuple[int, int]]:
    """Megatron's [start, end) of each part of a normalised split over `elements` sequences (a part with no share
    is empty)."""
    ends = [0.0]
    for share in split:
        ends.append(ends[-1] + share)
    return [(int(round(lo * float(elements))), int(round(hi * float(elements)))) if hi > lo else (0, 0)
            for lo, hi in zip(ends[:-1], ends[1:])]


def is_prefix(source: str) -> bool:
    """Whether `source` names an indexed-dataset prefix (PREFIX.bin and PREFIX.idx beside each other) or one of
    its two files."""
    base = _base(source)
    return Path(base + ".idx").is_file() or Path(base + ".bin").is_file()


def _base(source: str) -> str:
    return source[:-4] if source.endswith((".bin", ".idx")) else source


def prefix_parts(source: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (tokens, document starts), "val": (...)} of a Megatron prefix split as Megatron splits it; a
    missing file, or a split that leaves the train or validation part empty, refused by name."""
    from paratrain.data.indexed import IndexedTokens

    base = _base(source)
    missing = [f"{base}{suffix}" for suffix in (".bin", ".idx") if not Path(base + suffix).is_file()]
    if missing:
        raise ConfigError(f"the indexed corpus {base!r} lacks {missing}: Megatron's preprocess_data.py (and "
                          "`paratrain tokenize`) write PREFIX.bin and PREFIX.idx side by side; give the prefix of both")
    corpus = IndexedTokens(base)
    sequences = len(corpus.lengths)
    bounds = split_bounds(parse_split(split), sequences)
    # token offset of every sequence start (and of the end); which sequences begin a document
    offsets = np.append(np.asarray(corpus.pointers, dtype=np.int64) // corpus.dtype.itemsize, len(corpus.tokens))
    first_sequences = np.asarray(corpus.document_index[:-1], dtype=np.int64)
    parts = {}
    for name, (first, end) in (("train", bounds[0]), ("val", bounds[1])):
        if end <= first:
            raise ConfigError(f"--split {split} leaves the {'validation' if name == 'val' else 'training'} part of "
                              f"{base!r} empty ({sequences} sequences, parts {bounds}): give it a share, e.g. "
                              "--split 98,2,0, or add documents")
        lo, hi = int(offsets[first]), int(offsets[end])
        starts = offsets[first_sequences[(first_sequences >= first) & (first_sequences < end)]] - lo
        parts[name] = (corpus.tokens[lo:hi], starts)
    return parts
