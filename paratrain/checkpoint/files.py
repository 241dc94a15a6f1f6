"""What a sharded save writes (paratrain.checkpoint.sharded, and the asynchronous writer's the same): a rank's
pieces in one safetensors file, fsynced, with its size and SHA-256; and, on rank 0, meta.json of every rank's
share of the index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import save_file

from paratrain.checkpoint.io import SHARDED_FORMAT as FORMAT
from paratrain.checkpoint.io import _digest, _fsync_file, _fsync_write

Part = tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[dict[str, Any]]]
"""A rank's share of the index: (its files' sizes and SHA-256, its pieces, its optimizer scalars, its groups)."""


def write_rank_file(tmp: Path, rank: int, tensors: Mapping[str, torch.Tensor],
                    index: dict[str, Any]) -> dict[str, Any]:
    """This rank's pieces, fsynced into `tmp`; its files' entries (the index entries get their file's name)."""
    if not tensors:
        return {}
    file_name = f"rank-{rank:05d}.safetensors"
    save_file(dict(tensors), str(tmp / file_name))
    _fsync_file(tmp / file_name)
    for entry in index.values():
        entry["file"] = file_name
    return {file_name: {"bytes": (tmp / file_name).stat().st_size, "sha256": _digest(tmp / file_name)}}


def write_index(tmp: Path, step: int, parts: Sequence[Part], meta: dict[str, Any],
                attachments: Mapping[str, str | Path] | None) -> None:
    """Rank 0: the attachments copied in, then meta.json of every rank's part (meta: the run's extras and the
    engine's scalars), fsynced."""
    attached = {}
    for inside, source in (attachments or {}).items():
        (tmp / inside).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, tmp / inside)
        _fsync_file(tmp / inside)
        attached[inside] = {"bytes": (tmp / inside).stat().st_size, "sha256": _digest(tmp / inside)}
    document = index_document(step, parts, meta, attached)
    _fsync_write(tmp / "meta.json", json.dumps(document, indent=1, sort_keys=True))


def index_document(step: int, parts: Sequence[Part], meta: dict[str, Any],
                   attached: Mapping[str, Any]) -> dict[str, Any]:
    """meta.json's document: every rank's part merged (a save's, or the memory copies' of a step:
    paratrain.checkpoint.memory_copies); attached: the attachments' sizes and SHA-256."""
    document = {"format": FORMAT, "step": step, "world_size": len(parts), **meta,
                "files": {}, "tensors": {}, **({"attachments": dict(attached)} if attached else {}),
                "optimizer": {"param_groups": _merge_groups([p[3] for p in parts]), "scalars": {}}}
    for part_files, part_index, part_scalars, _ in parts:
        document["files"].update(part_files)
        document["optimizer"]["scalars"].update(part_scalars)
        for key, entry in part_index.items():
            whole = document["tensors"].setdefault(key, {"shape": entry["shape"], "dtype": entry["dtype"],
                                                          "pieces": []})
            whole["pieces"].append({k: entry[k] for k in ("file", "split", "lo", "hi")})
    return document


def _merge_groups(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Optimizer param groups of every rank, merged by their settings (pipeline stages each hold some)."""
    merged: dict[str, dict[str, Any]] = {}
    for groups in per_rank:
        for g in groups:
            settings = {k: v for k, v in g.items() if k != "params"}
            entry = merged.setdefault(repr(sorted(settings.items())), {**settings, "params": []})
            entry["params"] = sorted(set(entry["params"]) | set(g["params"]))
    return list(merged.values())
