"""Token files in Megatron-LM's indexed layout (PREFIX.bin + PREFIX.idx), read and written.

The de-facto standard of pre-tokenized corpora (Megatron-LM, Megatron-DeepSpeed, NeMo, torchtitan's
readers): PREFIX.bin holds every document's token ids back to back in one dtype; PREFIX.idx says where
each one is. The index, little-endian:

    b"MMIDIDX\\x00\\x00"          9 bytes, the magic
    version                    uint64, 1
    dtype code                 uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count             uint64: S
    document count             uint64: D + 1
    sequence lengths           int32[S], in tokens
    sequence pointers          int64[S], byte offsets into PREFIX.bin
    document indices           int64[D + 1]: document d is sequences [idx[d], idx[d + 1])

paratrain writes one sequence per document (each ending with the tokenizer's end-of-sequence id, as
Megatron's --append-eod does), so a document's tokens are contiguous in the .bin and the whole file is
the packed stream GlobalBatchLoader windows over. Reading accepts any file of this layout (several
sequences per document too): `tokens` is the .bin memory-mapped, `document_starts` where documents begin.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                           7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,535 entries), else int32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.int32)


class IndexedWriter:
    """Writes PREFIX.bin document by document, then PREFIX.idx on close()."""

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        if np.dtype(dtype) not in CODES:
            raise ValueError(f"the indexed layout has no code for dtype {dtype}: use one of {sorted(map(str, CODES))}")
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._bin: BinaryIO = open(self.prefix.with_suffix(".bin"), "wb")
        self.lengths: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        """One document (its ids, end-of-sequence included)."""
        array = np.asarray(ids)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(array.max())} does not fit {self.dtype} (the index's dtype)")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(int(array.size))

    def close(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.prefix.with_suffix(".idx"), "wb") as index:
            index.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODES[self.dtype]))
            index.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents)))
            index.write(lengths.tobytes() + pointers.tobytes() + documents.tobytes())


class IndexedTokens:
    """A PREFIX.bin / PREFIX.idx pair, read-only (the .bin memory-mapped)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        index_path = self.prefix.with_suffix(".idx")
        with open(index_path, "rb") as file:
            header = file.read(34)
        if header[:9] != MAGIC:
            raise ValueError(f"{index_path} is not an indexed-dataset index (its first bytes are {header[:9]!r}, not "
                             f"{MAGIC!r}): write it with `paratrain tokenize` or Megatron's preprocess_data.py")
        version, code = struct.unpack_from("<QB", header, 9)
        if version != VERSION or code not in DTYPES:
            raise ValueError(f"{index_path}: version {version}, dtype code {code}; "
                             f"paratrain reads version {VERSION} with codes {sorted(DTYPES)}")
        self.dtype = np.dtype(DTYPES[code])
        sequences, documents = struct.unpack_from("<QQ", header, 18)
        # the three arrays memory-mapped, not read: a corpus of many shards costs address space, not memory
        self.lengths = _mapped(index_path, np.int32, 34, sequences)
        self.pointers = _mapped(index_path, np.int64, 34 + 4 * sequences, sequences)
        self.document_index = _mapped(index_path, np.int64, 34 + 12 * sequences, documents)
        bin_path = self.prefix.with_suffix(".bin")
        size = bin_path.stat().st_size
        expected = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if sequences else 0
        if size < expected:
            raise ValueError(f"{bin_path} holds {size} bytes, and its index points to {expected}: the file is cut "
                             "short (write it again)")
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r", shape=(expected // self.dtype.itemsize,))
                       if expected else np.zeros(0, dtype=self.dtype))
        """Every sequence's ids back to back (the .bin, memory-mapped)."""

    @property
    def documents(self) -> int:
        return len(self.document_index) - 1

    @property
    def document_starts(self) -> np.ndarray:
        """int64 [documents]: the token offset of each document's first token in `tokens`."""
        first_sequences = self.document_index[:-1]
        return self.pointers[first_sequences] // self.dtype.itemsize if len(first_sequences) else np.zeros(0, np.int64)

    def document(self, d: int) -> np.ndarray:
        """Document d's ids (all its sequences)."""
        first, last = int(self.document_index[d]), int(self.document_index[d + 1])
        if first == last:
            return self.tokens[:0]
        start = int(self.pointers[first]) // self.dtype.itemsize
        end = int(self.pointers[last - 1]) // self.dtype.itemsize + int(self.lengths[last - 1])
        return self.tokens[start:end]


def _mapped(path: Path, dtype: type, offset: int, count: int) -> np.ndarray:
    """`count` values of `dtype` at byte `offset` of `path`, memory-mapped read-only (an empty array for none)."""
    if not count:
        return np.zeros(0, dtype=dtype)
    size = path.stat().st_size
    if offset + count * np.dtype(dtype).itemsize > size:
        raise ValueError(f"{path} holds {size} bytes, and its header promises {count} {np.dtype(dtype)} values at "
                         f"byte {offset}: the index is cut short (write it again)")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
