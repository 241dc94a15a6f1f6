"""Layout-free checkpoints on disk: tensors in safetensors, everything else in JSON.

    DIR/latest                       name of the newest complete checkpoint ("step_00000100")
    DIR/step_00000100/model.safetensors      model tensors by parameter name (full, unsharded)
    DIR/step_00000100/optimizer.safetensors  optimizer tensors as "<param name>::<state key>"
    DIR/step_00000100/meta.json      step, run config, loader state, optimizer hyper-parameters

A checkpoint is written into a temporary folder and renamed into place, then `latest` is replaced
atomically; a crash mid-write leaves the previous checkpoint intact. Loading never unpickles.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "paratrain-checkpoint/1"
_SEP = "::"


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _split_optimizer(optimizer: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, values in optimizer["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}{_SEP}{key}"] = _cpu(value)
            else:
                scalars.setdefault(name, {})[key] = value
    return tensors, {"param_groups": optimizer["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for flat, tensor in tensors.items():
        name, key = flat.rsplit(_SEP, 1)
        state.setdefault(name, {})[key] = tensor
    for name, values in meta["scalars"].items():
        state.setdefault(name, {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(root: str | Path, step: int, engine_state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write one checkpoint under `root` and point `latest` at it; returns its folder.

    engine_state: Engine.state_dict() (full model and optimizer state). meta: JSON-able extras.
    Call on one rank only (all ranks hold the full state in data parallelism).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: _cpu(v) for k, v in engine_state["model"].items()}, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _split_optimizer(engine_state["optimizer"])
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    document = {"format": FORMAT, "step": step, "optimizer": opt_meta, **meta}
    if "loss_scaler" in engine_state:
        document["loss_scaler"] = engine_state["loss_scaler"]
    _fsync_write(tmp / "meta.json", json.dumps(document, indent=1, sort_keys=True))
    final = root / name
    if final.exists():  # re-saving the same step: move the old one aside first
        trash = root / f".old-{name}-{os.getpid()}"
        os.replace(final, trash)
        shutil.rmtree(trash)
    os.replace(tmp, final)
    _fsync_write(root / ".latest.tmp", name + "\n")
    os.replace(root / ".latest.tmp", root / "latest")
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder itself, or a root whose `latest` names one."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        return path / latest.read_text().strip()
    raise FileNotFoundError(f"{str(path)!r} is neither a checkpoint folder (meta.json) nor a root with a 'latest' file")


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine_state, meta) of a checkpoint saved by save_checkpoint; tensors on CPU."""
    folder = resolve_checkpoint(path)
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(folder)!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
    model = load_file(str(folder / "model.safetensors"))
    optimizer = _join_optimizer(load_file(str(folder / "optimizer.safetensors")), meta.pop("optimizer"))
    engine_state = {"model": model, "optimizer": optimizer}
    if "loss_scaler" in meta:
        engine_state["loss_scaler"] = meta.pop("loss_scaler")
    return engine_state, meta
