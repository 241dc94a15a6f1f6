"""`paratrain inspect CKPT` and `paratrain export CKPT OUT.safetensors`: a checkpoint read without training.

inspect verifies the checkpoint (sizes, SHA-256, shapes, dtypes) and says what it holds: the step,
the layout and world size it was saved from, the model, and every tensor with its shape, dtype and
size. export writes the model's tensors alone, under the plain model's parameter names, to one
safetensors file that any tool reads (optionally cast to another floating dtype); optimizer state,
loader and RNG positions stay behind.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from paratrain.checkpoint.io import SHARDED_FORMAT, model_names, resolve_checkpoint, verify_checkpoint
from paratrain.checkpoint.sharded import CheckpointReader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1}


def describe_checkpoint(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds (verified first): {"folder", "step", "world_size", "format", "files"
    (name -> bytes), "layout", "model", "tensors": {file: [{"name", "shape", "dtype", "bytes"}]}, "params"}
    (params: model elements). A sharded checkpoint's logical tensors are listed under
    "model.safetensors" and "optimizer.safetensors", the files of a whole one."""
    folder = resolve_checkpoint(path)
    meta = verify_checkpoint(folder)
    config = meta.get("config", {})
    tensors: dict[str, list[dict[str, Any]]] = {}
    if meta.get("format") == SHARDED_FORMAT:  # one index of logical tensors: shown as the files of format 1
        whole: dict[str, dict[str, list[Any]]] = {"model.safetensors": {}, "optimizer.safetensors": {}}
        for key, entry in meta["tensors"].items():
            whole["optimizer.safetensors" if "::" in key else "model.safetensors"][key] = [entry["shape"], entry["dtype"]]
        meta = {**meta, "tensors": whole}
    for file_name, index in meta.get("tensors", {}).items():
        rows = []
        for name, (shape, dtype) in sorted(index.items()):
            numel = 1
            for size in shape:
                numel *= size
            rows.append({"name": name, "shape": shape, "dtype": dtype, "bytes": numel * _BYTES.get(dtype, 0)})
        tensors[file_name] = rows
    model_rows = tensors.get("model.safetensors", [])
    return {"folder": str(folder), "step": meta.get("step"), "world_size": meta.get("world_size"),
            "format": meta.get("format"), "files": {k: v["bytes"] for k, v in meta.get("files", {}).items()},
            "layout": config.get("parallel", {}), "model": config.get("model", {}), "tensors": tensors,
            "params": sum(r["bytes"] // max(_BYTES.get(r["dtype"], 1), 1) for r in model_rows)}


def format_description(record: dict[str, Any]) -> str:
    layout = record["layout"]
    axes = " x ".join(f"{axis} {layout.get(axis)}" for axis in ("dp", "tp", "pp") if layout.get(axis) is not None)
    extras = [f"ZeRO {layout['zero']}" if layout.get("zero") else "",
              "sequence parallel" if layout.get("sequence_parallel") else "",
              f"{layout.get('schedule')}" if (layout.get("pp") or 1) > 1 else ""]
    model = record["model"]
    lines = [f"{record['folder']}: step {record['step']}, saved by {record['world_size']} process(es) as "
             f"{axes or 'one process'}{''.join(', ' + e for e in extras if e)}",
             (f"model {model['hf']} (Hugging Face)" if model.get("hf") else
              f"model {model.get('preset', '?')}{' ' + str(model['overrides']) if model.get('overrides') else ''}")
             + f": {record['params']:,} parameters (loads under any layout)"]
    if record.get("format") == SHARDED_FORMAT:
        lines.append(f"sharded: {len(record['files'])} rank files, {sum(record['files'].values()) / 2**20:.1f} MiB "
                     "(below: the logical tensors they hold pieces of)")
    for file_name, rows in record["tensors"].items():
        total = sum(r["bytes"] for r in rows)
        lines.append(f"{file_name}: {len(rows)} tensors, {total / 2**20:.1f} MiB")
        width = max((len(r["name"]) for r in rows), default=0)
        for r in rows:
            lines.append(f"  {r['name']:<{width}}  {str(r['shape']):<16} {r['dtype']:<9} {r['bytes'] / 2**20:>9.2f} MiB")
    return "\n".join(lines)


def export_model(path: str | Path, out: str | Path, *, dtype: str | None = None) -> dict[str, Any]:
    """Write the checkpoint's model tensors (verified first) to one safetensors file `out`, cast to
    `dtype` (a floating dtype name) when given; returns {"tensors", "bytes", "out"}."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = resolve_checkpoint(path)
    meta = verify_checkpoint(folder)
    tensors = {}
    if meta.get("format") == SHARDED_FORMAT:  # each tensor assembled from its pieces
        reader = CheckpointReader(folder, meta)
        for name in model_names(meta):
            saved = reader.open(name)
            tensor = saved.values(saved.shape, 0, math.prod(saved.shape)).view(saved.shape)
            tensors[name] = tensor.to(DTYPES[dtype]) if dtype is not None and tensor.is_floating_point() else tensor
    else:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(DTYPES[dtype])
                tensors[name] = tensor.contiguous()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "source": str(folder), "step": str(meta.get("step"))})
    return {"tensors": len(tensors), "bytes": out.stat().st_size, "out": str(out)}
