"""Export a paratrain checkpoint of a Hugging Face model as a folder `from_pretrained` loads.

    paratrain export CKPT OUT --hf [SOURCE] [--dtype bfloat16] [--max-shard-size 5GB]

CKPT is a checkpoint paratrain wrote (sharded, from any layout); SOURCE the folder the model came from
(paratrain.hf.from_pretrained's), whose config.json, generation_config.json and tokenizer files travel with
the weights. Without SOURCE, the copies of those files a checkpoint of an `--hf` run carries (its hf/ folder,
listed with their SHA-256 in meta.json) are read: the source folder may be gone by the time a run is exported.
A mixture-of-experts family's stacked experts are written one tensor per expert, as the Hub's files hold them
(paratrain.hf.files). Written, into a folder renamed into place at the end (an existing OUT is refused):

- the weights as safetensors shards of at most max_shard_size bytes (one tensor larger than that gets a
  shard of its own), model-0000i-of-0000N.safetensors with model.safetensors.index.json, or one
  model.safetensors when they fit in one; streamed: each shard's header is written from the shapes first,
  then each tensor is assembled from the checkpoint's pieces, cast, written and dropped, so the process
  holds one tensor of the model at a time;
- only the model's own tensors under their Hugging Face names: a tied head is the embedding (the
  checkpoint holds it once), optimizer state stays behind; the names are checked against the model
  SOURCE's config.json builds, both ways, and a difference refused by name; so are the shapes, except the
  rows a padded vocabulary added (from_pretrained(pad_vocab_to=)), which are trimmed;
- config.json with its dtype set to the exported one; every other file of SOURCE that is a tokenizer's or
  the generation config, byte for byte.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.io import SHARDED_FORMAT, model_names, resolve_checkpoint, verify_checkpoint
from paratrain.checkpoint.sharded import CheckpointReader
from paratrain.config.errors import ConfigError
from paratrain.data.tokenize import TOKENIZER_FILES
from paratrain.hf.files import INDEX, WEIGHTS, file_parts
from paratrain.hf.load import expected_shapes

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '20KiB' or a number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    value = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if value.endswith(unit):
            return int(float(value[: -len(unit)]) * UNITS[unit])
    return int(value)


CARRIED = "hf"
"""The folder inside a checkpoint of an `--hf` run holding its model's configuration and tokenizer files."""


def carried_files(folder: str | Path) -> dict[str, str]:
    """What each checkpoint of a run of the HF model `folder` carries (its config.json, generation config and
    tokenizer files), name inside the checkpoint -> file: export_pretrained then needs no source folder."""
    folder = Path(folder)
    names = ("config.json", *TOKENIZER_FILES)
    return {f"{CARRIED}/{name}": str(folder / name) for name in names if (folder / name).is_file()}


def export_pretrained(checkpoint: str | Path, out: str | Path, *, source: str | Path | None = None,
                      dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB") -> dict[str, Any]:
    """Write OUT as the module docstring says; returns {"out", "tensors", "bytes", "shards"}. source: the folder the
    model was loaded from; None: the configuration the checkpoint carries (an `--hf` run's, CARRIED)."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: the export publishes a new folder; remove it or choose another")
    folder = resolve_checkpoint(checkpoint)
    if source is None:
        source = folder / CARRIED
        if not (source / "config.json").is_file():
            raise ConfigError(f"{folder} carries no Hugging Face configuration ({CARRIED}/config.json: a checkpoint of "
                              "a run without --hf, or written before checkpoints carried it): give the folder the "
                              "model was loaded from, `paratrain export CKPT OUT --hf SOURCE`")
    source = Path(source)
    meta = verify_checkpoint(folder)
    if meta.get("format") != SHARDED_FORMAT:
        raise ConfigError(f"{folder} is not a sharded checkpoint (format {meta.get('format')!r}): export --hf reads "
                          "the checkpoints `--save` and save_sharded write")
    reader = CheckpointReader(folder, meta)
    names = model_names(meta)
    shapes = expected_shapes(source)
    missing, unexpected = sorted(set(shapes) - set(names)), sorted(set(names) - set(shapes))
    if missing or unexpected:
        raise ConfigError(f"the checkpoint {folder} and the model {source}/config.json builds differ: missing from "
                          f"the checkpoint {missing[:6]}, not in the model {unexpected[:6]}: export with the --hf "
                          "folder the run started from")
    config = json.loads((source / "config.json").read_text())
    vocab = config.get("vocab_size")
    for name in names:  # only a vocabulary's rows may be more (from_pretrained's padding, trimmed here)
        saved = tuple(reader.open(name).shape)
        padded = shapes[name][:1] == (vocab,) and saved[1:] == shapes[name][1:] and saved[:1] > shapes[name][:1]
        if saved != shapes[name] and not padded:
            raise ConfigError(f"{name} is {list(saved)} in the checkpoint {folder} and {list(shapes[name])} in the "
                              f"model {source}/config.json builds: export with the --hf folder the run started from")
    shards = _plan(_entries(reader, shapes, names, dtype, config.get("model_type", "")), parse_size(max_shard_size))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = ([WEIGHTS] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        total = 0
        for file, shard in zip(files, shards):
            total += _write_shard(staging / file, reader, shard)
        if len(files) > 1:
            weight_map = {entry.key: file for file, shard in zip(files, shards) for entry in shard}
            (staging / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2))
        _copy_configuration(source, staging, dtype or _saved_dtype(reader, names))
        staging.rename(out)
        return {"out": str(out), "tensors": len(names), "bytes": total, "shards": len(files)}
    finally:
        shutil.rmtree(staging, ignore_errors=True)


Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class _Entry:
    """One tensor of the exported files: elements [lo, lo + its size) of a checkpoint tensor (a whole tensor, or one
    expert's projection of a stacked one: paratrain.hf.files)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str
    lo: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _entries(reader: CheckpointReader, shapes: Shapes, names: list[str], dtype: torch.dtype | None,
             model_type: str) -> list[_Entry]:
    """The files' tensors, by name: each checkpoint tensor at the model's shape (a padded vocabulary's first rows)
    and the exported dtype, cut into its family's file tensors."""
    entries = []
    for name in names:
        saved = reader.open(name)
        cast = dtype if dtype is not None and saved.dtype.is_floating_point else saved.dtype
        lo = 0
        for part in file_parts(model_type, name, shapes[name]):
            entries.append(_Entry(part.key, part.shape, cast, name, lo))
            lo += part.numel
    return sorted(entries, key=lambda e: e.key)


def _plan(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Tensors by shard, in name order: a new shard when the next tensor would pass `limit` bytes."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_shard(path: Path, reader: CheckpointReader, entries: list[_Entry]) -> int:
    """One safetensors file: its header from the shapes, then each tensor read from the checkpoint (its elements
    from entry.lo: the elements before a padded vocabulary's padding, an expert's piece), cast and written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.key] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as stream:
        stream.write(struct.pack("<Q", len(encoded)) + encoded)
        for entry in entries:
            saved = reader.open(entry.source)
            tensor = saved.values(saved.shape, entry.lo, entry.lo + math.prod(entry.shape)).to(entry.dtype).contiguous()
            stream.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return offset


def _saved_dtype(reader: CheckpointReader, names: list[str]) -> torch.dtype:
    for name in names:
        saved = reader.open(name)
        if saved.dtype.is_floating_point:
            return saved.dtype
    return torch.float32


def _copy_configuration(source: Path, staging: Path, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    (staging / "config.json").write_text(json.dumps({**config, **dict.fromkeys(keys, name)}, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copyfile(source / file, staging / file)
