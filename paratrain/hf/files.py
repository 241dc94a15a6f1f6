"""The files of a Hugging Face folder: where each tensor is, how a family's files name and cut the model's tensors
where they differ from the module's own, and the Source that reads element ranges of the model's tensors from them.

A folder as `save_pretrained` writes it holds model.safetensors, or shards model-0000i-of-0000N.safetensors with
model.safetensors.index.json (weight_files). HFCheckpoint is a paratrain.hybrid.materialize Source: each rank reads
only the rows its pieces need (safetensors' lazy slices), converted to the model's dtype.

transformers (5.x) builds a mixture-of-experts layer with each layer's experts stacked in two tensors,

    model.layers.{i}.mlp.experts.gate_up_proj   [E, 2 I, D]   expert e: its gate rows, then its up rows
    model.layers.{i}.mlp.experts.down_proj      [E, D, I]

while the files on the Hub (and those save_pretrained writes) hold one tensor per expert and projection:

    mixtral              model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight   (gate / up / down)
                         model.layers.{i}.block_sparse_moe.gate.weight                        (the router)
    qwen2_moe, qwen3_moe, deepseek_v3
                         model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight

(gpt-oss's files hold its experts stacked, as its module does: nothing to convert.)

Every such conversion here is a concatenation of the files' tensors, flattened, in order: the stacked
gate_up_proj is w1_0 | w3_0 | w1_1 | w3_1 | ... as flat elements. So a model tensor is a list of Parts (a file's
tensor name and shape), and any element range of it, a rank's ZeRO shard, a tensor-parallel slice's rows,
reads only the parts it overlaps (paratrain.hf.load); export writes each part back under its own name
(paratrain.hf.export). tests/distributed/test_hf_load.py checks the result equals transformers' own
from_pretrained.
A model's tensor the files already hold under its own name (files written fused) is read as it is.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from paratrain.config.errors import ConfigError
from paratrain.models.init import Given, ParamInit

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


@dataclass(frozen=True)
class Part:
    """One tensor of the files, a piece of a model tensor's flat elements."""

    key: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<tensor>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.gate\.weight$")
_PROJECTIONS = {"mixtral": ("block_sparse_moe", "w1.weight", "w3.weight", "w2.weight"),
                "qwen2_moe": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                "qwen3_moe": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                "deepseek_v3": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight")}
"""model_type -> (the experts' module in the files, gate, up and down projections' names)."""


def file_parts(model_type: str, name: str, shape: tuple[int, ...]) -> list[Part]:
    """The files' tensors whose flattened concatenation is the model's tensor `name` of `shape`."""
    if model_type not in _PROJECTIONS:
        return [Part(name, shape)]
    where, gate, up, down = _PROJECTIONS[model_type]
    experts = _EXPERTS.match(name)
    if experts:
        prefix = f"{experts['layer']}.{where}.experts"
        if experts["tensor"] == "gate_up_proj":  # [E, 2I, D]: per expert its gate [I, D] then its up [I, D]
            count, rows, width = shape
            return [Part(f"{prefix}.{e}.{proj}", (rows // 2, width)) for e in range(count) for proj in (gate, up)]
        count, rows, width = shape  # down_proj [E, D, I]
        return [Part(f"{prefix}.{e}.{down}", (rows, width)) for e in range(count)]
    router = _ROUTER.match(name)
    if router and where != "mlp":
        return [Part(f"{router['layer']}.{where}.gate.weight", shape)]
    return [Part(name, shape)]


def files_layout(model_type: str, shapes: dict[str, tuple[int, ...]],
                 in_files: set[str] | None = None) -> dict[str, list[Part]]:
    """name -> its Parts for every model tensor of `shapes`; a name `in_files` holds itself reads as it is."""
    return {name: ([Part(name, shape)] if in_files is not None and name in in_files
                   else file_parts(model_type, name, shape)) for name, shape in shapes.items()}


class _Rows:
    """Elements [lo, hi) of one tensor of a safetensors file, read by whole rows of its first dim."""

    def __init__(self, path: Path, key: str, vocab: tuple[int, int] | None = None) -> None:
        """vocab: (real, padded) rows when the model's vocabulary is padded: a tensor of `real` rows in the
        file and `padded` in the model reads zeros past its last row."""
        self.path, self.key, self.vocab = path, key, vocab

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            view = handle.get_slice(self.key)
            saved = tuple(view.get_shape())
            if self.vocab and saved[:1] == self.vocab[:1] and (self.vocab[1], *saved[1:]) == tuple(shape):
                stored = math.prod(saved)  # the file's rows, then zeros for the padding rows
                head = self._read(view, saved, lo, min(hi, stored))
                return torch.cat((head, head.new_zeros(max(0, hi - max(lo, stored)))))
            if saved != tuple(shape):
                raise ConfigError(f"{self.key} in {self.path.name} has shape {saved}, the model's is {tuple(shape)}: "
                                  "the config.json and the weights do not belong together")
            return self._read(view, saved, lo, hi)

    @staticmethod
    def _read(view: Any, saved: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        if lo >= hi:
            return view[0:0].reshape(-1)
        if len(saved) <= 1:
            return view[lo:hi].reshape(-1)
        row = math.prod(saved[1:])
        first, last = lo // row, -(-hi // row)
        return view[first:last].reshape(-1)[lo - first * row: hi - first * row]


class _Parts:
    """A model tensor the files hold in pieces (paratrain.hf.files: experts one by one): elements [lo, hi) read
    from the pieces they overlap."""

    def __init__(self, pieces: list[tuple[_Rows, Part]]) -> None:
        self.pieces = pieces

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        if sum(part.numel for _, part in self.pieces) != math.prod(shape):
            raise ConfigError(f"the files' pieces {[p.key for _, p in self.pieces][:4]} ... hold "
                              f"{sum(p.numel for _, p in self.pieces)} elements, the model's tensor {tuple(shape)}: "
                              "the config.json and the weights do not belong together")
        read, start = [], 0
        for rows, part in self.pieces:
            a, b = max(lo, start), min(hi, start + part.numel)
            if a < b:
                read.append(rows.values(part.shape, a - start, b - start))
            start += part.numel
        return torch.cat(read) if read else torch.empty(0)


class HFCheckpoint:
    """A Source (paratrain.hybrid.materialize) over a folder's safetensors files."""

    def __init__(self, folder: str | Path, buffers: dict[str, torch.Tensor],
                 vocab: tuple[int, int] | None = None, parts: dict[str, list[Part]] | None = None) -> None:
        self.folder = Path(folder)
        self.vocab = vocab
        self.files = weight_files(self.folder)
        self.buffers = buffers
        """Tensors the files do not hold, computed here (non-persistent buffers)."""
        self.parts = parts or {}
        """Model tensors the files hold in pieces under other names (paratrain.hf.files)."""

    def open(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> ParamInit:
        if name in self.buffers:
            return Given(self.buffers[name])
        parts = self.parts.get(name)
        if parts and [p.key for p in parts] != [name]:
            absent = [p.key for p in parts if p.key not in self.files]
            if absent:
                raise ConfigError(f"{name}: its pieces {absent[:4]} are not in the checkpoint's files ({self.folder})")
            return _Parts([(_Rows(self.folder / self.files[p.key], p.key), p) for p in parts])
        if name not in self.files:
            raise ConfigError(f"{name} is not in the checkpoint's files ({self.folder})")
        return _Rows(self.folder / self.files[name], name, self.vocab)


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (in `folder`) holding it."""
    if (folder / INDEX).is_file():
        return dict(json.loads((folder / INDEX).read_text())["weight_map"])
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS), framework="pt") as handle:
            return {key: WEIGHTS for key in handle.keys()}
    raise ConfigError(f"{folder} holds no {WEIGHTS} nor {INDEX} (a folder save_pretrained wrote has one); "
                      "paratrain reads safetensors weights only")


def files_dtype(folder: Path, files: dict[str, str]) -> torch.dtype:
    """The dtype of the files' floating tensors (one row of the first one read)."""
    from safetensors import safe_open

    for name in sorted(files):
        with safe_open(str(folder / files[name]), framework="pt") as handle:
            first = handle.get_slice(name)[:1]
        if first.is_floating_point():
            return first.dtype
    return torch.float32
