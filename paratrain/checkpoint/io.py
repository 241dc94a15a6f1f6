"""Layout-free checkpoints on disk: tensors in safetensors, everything else in JSON.

    DIR/latest                       name of the newest complete checkpoint ("step_00000100")
    DIR/step_00000100/model.safetensors      model tensors by parameter name (full, unsharded)
    DIR/step_00000100/optimizer.safetensors  optimizer tensors as "<param name>::<state key>"
    DIR/step_00000100/meta.json      step, run config, loader state, optimizer hyper-parameters

A checkpoint is written into a temporary folder (every file fsynced) and renamed into place, then
`latest` is replaced atomically; a crash mid-write leaves the previous checkpoint intact. meta.json
holds each tensor file's size and SHA-256 and each tensor's shape and dtype: loading verifies them
first, and a checkpoint that fails names the file, what is wrong, and the newest older checkpoint that
verifies. Loading never unpickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Collection

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from paratrain.data_parallel.diloco import REPLICA_PREFIX

FORMAT = "paratrain-checkpoint/1"
SHARDED_FORMAT = "paratrain-checkpoint/2"
"""paratrain.checkpoint.sharded: one file per rank, an index in meta.json."""
_SEP = "::"


def model_names(meta: dict[str, Any]) -> list[str]:
    """The model's tensors in a sharded checkpoint's index, sorted: not the optimizer's state (NAME::KEY), not a
    DiLoCo replica group's own copy (REPLICA_PREFIX G/NAME: the first group's state is the plain names')."""
    return sorted(k for k in meta["tensors"] if "::" not in k and not k.startswith(REPLICA_PREFIX))


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


class CheckpointError(ValueError):
    """A checkpoint that does not verify: the message names the file, what is wrong, and the newest
    older checkpoint that verifies."""


_TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(root: str | Path, step: int, engine_state: dict[str, Any], meta: dict[str, Any], *,
                    keep_last: int = 0) -> Path:
    """Write one checkpoint under `root` and point `latest` at it; returns its folder.

    engine_state: Engine.state_dict() (full model and optimizer state). meta: JSON-able extras.
    keep_last: then delete all but the newest this many step_* folders (0: keep every one).
    Call on one rank only (all ranks hold the full state in data parallelism).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model = {k: _cpu(v) for k, v in engine_state["model"].items()}
    opt_tensors, opt_meta = _split_optimizer(engine_state["optimizer"])
    files, tensors = {}, {}
    for file_name, content in zip(_TENSOR_FILES, (model, opt_tensors)):
        save_file(content, str(tmp / file_name))
        _fsync_file(tmp / file_name)
        files[file_name] = {"bytes": (tmp / file_name).stat().st_size, "sha256": _digest(tmp / file_name)}
        tensors[file_name] = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in content.items()}
    document = {"format": FORMAT, "step": step, "optimizer": opt_meta, "files": files, "tensors": tensors, **meta}
    if "loss_scaler" in engine_state:
        document["loss_scaler"] = engine_state["loss_scaler"]
    _fsync_write(tmp / "meta.json", json.dumps(document, indent=1, sort_keys=True))
    return _publish(root, tmp, name, keep_last=keep_last)


def _publish(root: Path, tmp: Path, name: str, *, keep_last: int) -> Path:
    """Rename a complete, fsynced checkpoint folder `tmp` to root/name, then point `latest` at it
    (atomically, the renames fsynced), then apply keep_last."""
    final = root / name
    if final.exists():  # re-saving the same step: move the old one aside first
        trash = root / f".old-{name}-{os.getpid()}"
        os.replace(final, trash)
        shutil.rmtree(trash)
    os.replace(tmp, final)
    _fsync_write(root / ".latest.tmp", name + "\n")
    os.replace(root / ".latest.tmp", root / "latest")
    directory = os.open(root, os.O_RDONLY)  # the renames themselves reach the disk
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    if keep_last:  # only once the new one is complete and `latest` names it
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old)
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


def verify_checkpoint(folder: str | Path, *, hashed: Collection[str] | None = None,
                      hint: bool = True) -> dict[str, Any]:
    """Check one checkpoint folder against its meta.json (files present, sizes, SHA-256, each tensor's
    shape and dtype); returns the meta, or raises CheckpointError naming the file and the newest
    older checkpoint of the same root that verifies. hashed: the files whose SHA-256 is checked (None:
    all; the rest get every other check: paratrain.checkpoint.sharded.verify_shared splits hashing
    over ranks). hint: name the newest older checkpoint that verifies (False: only the error)."""
    folder = Path(folder)
    try:
        meta = _verified_meta(folder, hashed)
    except CheckpointError as error:
        if not hint:
            raise
        raise CheckpointError(f"{error}; {older_hint(folder)}") from None
    return meta


def older_hint(folder: Path) -> str:
    """Where to resume from instead of `folder`: the newest older checkpoint of its root that verifies."""
    older = newest_verified(folder.parent, before=folder.name)
    return (f"the newest older checkpoint that verifies is {older} (--resume {older})" if older else
            "no older checkpoint in this folder verifies")


def _verified_meta(folder: Path, hashed: Collection[str] | None = None) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder / 'meta.json'} cannot be read: {error}") from None
    if meta.get("format") == SHARDED_FORMAT:
        _verify_sharded(folder, meta, hashed)
        return meta
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder} has format {meta.get('format')!r}, expected {FORMAT!r} or {SHARDED_FORMAT!r}")
    for file_name in _TENSOR_FILES:
        path = folder / file_name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        expected = meta.get("files", {}).get(file_name)
        if expected is None:  # written before checksums were kept: its headers are all there is to check
            continue
        found = _checked_file(path, expected, digest=hashed is None or file_name in hashed)
        index = meta.get("tensors", {}).get(file_name, {})
        wrong = sorted(k for k in set(index) | set(found) if index.get(k) != found.get(k))
        if wrong:
            raise CheckpointError(f"{path}: tensors {wrong[:4]} differ from the index in meta.json (shape or dtype)")
    return meta


def _checked_file(path: Path, expected: dict[str, Any], *, digest: bool = True) -> dict[str, list[Any]]:
    """The [shape, dtype] of every tensor in the safetensors file `path`, once its size and (digest)
    SHA-256 are those written with it (meta.json's `expected`)."""
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, {expected['bytes']} were written (cut short or replaced)")
    if digest and not digest_matches(path, expected):
        raise CheckpointError(f"{path} does not match the SHA-256 written with it (corrupted)")
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            return {k: [list(s.get_shape()), _dtype_name(s.get_dtype())] for k, s in slices.items()}
    except SafetensorError as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def digest_matches(path: Path, expected: dict[str, Any]) -> bool:
    """Whether the file's SHA-256 is the one written with it (meta.json's files entry)."""
    return _digest(path) == expected["sha256"]


def _verify_sharded(folder: Path, meta: dict[str, Any], hashed: Collection[str] | None = None) -> None:
    """A sharded checkpoint (paratrain.checkpoint.sharded): every rank file present with its size and
    SHA-256 (of the `hashed` files; None: all), every indexed piece in its file with its length and
    dtype, every tensor covered whole."""
    for name, expected in meta.get("attachments", {}).items():  # files beside the tensors (an --hf run's config)
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size != expected["bytes"] or not digest_matches(path, expected):
            raise CheckpointError(f"{path} does not match the size and SHA-256 written with it")
    headers: dict[str, dict[str, list[Any]]] = {}
    for file_name, expected in meta.get("files", {}).items():
        path = folder / file_name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        headers[file_name] = _checked_file(path, expected, digest=hashed is None or file_name in hashed)
    for key, entry in meta.get("tensors", {}).items():
        total = 0
        for piece in entry["pieces"]:
            found = headers.get(piece["file"], {}).get(key)
            if found != [[piece["hi"] - piece["lo"]], entry["dtype"]]:
                raise CheckpointError(f"{folder / piece['file']}: piece of {key} is {found}, the index says "
                                      f"{[piece['hi'] - piece['lo']]} {entry['dtype']}")
            total += piece["hi"] - piece["lo"]
        numel = math.prod(entry["shape"])
        if total != numel:
            raise CheckpointError(f"{folder}: the pieces of {key} hold {total} of its {numel} elements")


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _dtype_name(code: str) -> str:
    return _SAFETENSORS_DTYPES.get(code, code)


def newest_verified(root: str | Path, *, before: str | None = None) -> Path | None:
    """The newest step_* checkpoint under root that verifies (older than `before` when given), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    for folder in sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True):
        if before is not None and folder.name >= before:
            continue
        try:
            _verified_meta(folder)
        except CheckpointError:
            continue
        return folder
    return None


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine_state, meta) of a checkpoint saved by save_checkpoint, verified first; tensors on CPU."""
    folder = resolve_checkpoint(path)
    meta = verify_checkpoint(folder)
    for key in ("files", "tensors"):
        meta.pop(key, None)
    model = load_file(str(folder / "model.safetensors"))
    optimizer = _join_optimizer(load_file(str(folder / "optimizer.safetensors")), meta.pop("optimizer"))
    engine_state = {"model": model, "optimizer": optimizer}
    if "loss_scaler" in meta:
        engine_state["loss_scaler"] = meta.pop("loss_scaler")
    return engine_state, meta
