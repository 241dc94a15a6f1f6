"""Sharded checkpoints: every rank writes its own pieces; loading under any layout reads only its own.

    DIR/latest                             name of the newest complete checkpoint
    DIR/step_00000100/rank-00003.safetensors   rank 3's pieces, 1-D, keyed by whole-model name
                                           ("blocks.0.mlp.up.weight", "blocks.0.mlp.up.weight::exp_avg")
    DIR/step_00000100/meta.json            step, run config, loader, dropout step, loss scale, optimizer
                                           hyper-parameters and scalar state; every file's size and
                                           SHA-256; the index: every logical tensor's whole shape and
                                           dtype and which file holds which slice of it

A piece is a slice of a whole tensor (whole, or part `index` of `parts` along `dim`: tensor
parallelism) and a range [lo, hi) of that slice's flattened elements (a ZeRO shard cuts through
tensors). Model values are the exact ones (ZeRO's float32 masters); optimizer state tensors shaped
like a parameter are pieces the same way. Replicas are written once: the first data-parallel replica,
the first tensor-parallel rank of a replicated tensor, the first end of a pipeline's tied weight.

Save (collective; the folder must be on a filesystem every rank sees): every rank writes and fsyncs
its file into one temporary folder, then sends its index (sizes, SHA-256, pieces; no tensor) to rank
0, which writes meta.json, renames the folder into place and then moves `latest`. A crash before that
leaves the previous checkpoint as `latest`, complete. Load: each rank asks the index, for every
tensor piece it keeps under its own layout, which saved pieces overlap it and reads only those
elements (paratrain.hybrid.pieces maps both sides); nothing is unpickled, no rank assembles the whole
model unless its own layout keeps it whole.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from paratrain.checkpoint.io import (
    CheckpointError,
    _publish,
    digest_matches,
    older_hint,
    resolve_checkpoint,
    verify_checkpoint,
)
from paratrain.checkpoint.files import write_index, write_rank_file
from paratrain.hybrid.pieces import Piece
from paratrain.hybrid.view import DTYPES, LocalState, StateError, StateView

def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_sharded(root: str | Path, step: int, view: StateView, meta: dict[str, Any], *, keep_last: int = 0,
                 before_publish: Callable[[], None] | None = None,
                 attachments: Mapping[str, str | Path] | None = None) -> Path:
    """Write one sharded checkpoint of an engine's state (`engine.view()`) under `root` and point `latest`
    at it; returns its folder. Collective: every rank calls it. meta: JSON-able extras (rank 0's are kept).
    keep_last: then delete all but the newest this many step_* folders (0: keep every one).
    before_publish: called on every rank once its own file is on disk (the trainer's fault injection).
    attachments: files rank 0 copies into the checkpoint, name inside it -> source (an `--hf` run's config.json and
    tokenizer files under hf/, so that `paratrain export --hf` needs no source folder), each listed in meta.json's
    "attachments" with its size and SHA-256 (verify_checkpoint checks them)."""
    root, name, tmp = Path(root), f"step_{step:08d}", prepare_folder(root, step, view.mesh.rank)
    local = local_state(view)
    rank = view.mesh.rank
    files = write_rank_file(tmp, rank, local.tensors, local.index)
    if before_publish is not None:
        before_publish()
    parts = _gather((files, local.index, local.scalars, local.groups))
    if rank == 0:
        write_index(tmp, step, parts, {**meta, **view.scalars()}, attachments)
        _publish(root, tmp, name, keep_last=keep_last)
    _barrier()
    return root / name


def prepare_folder(root: str | Path, step: int, rank: int) -> Path:
    """Collective: rank 0 makes the step's empty temporary folder (a save of this step that died before it was
    published is removed first), the others wait for it."""
    tmp = Path(root) / f".tmp-step_{step:08d}"
    if rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    return tmp


def local_state(view: StateView, *, to_cpu: bool = True) -> LocalState:
    try:
        return view.local_state(to_cpu=to_cpu)
    except StateError as error:
        raise CheckpointError(str(error)) from None


class SavedTensor:
    """Values of one logical tensor of a sharded checkpoint, read from the pieces that overlap a request."""

    def __init__(self, reader: CheckpointReader, key: str) -> None:
        entry = reader.index[key]
        self.reader, self.key = reader, key
        self.shape = tuple(entry["shape"])
        self.dtype = DTYPES[entry["dtype"]]
        self.pieces = [(Piece(key, self.shape, self.dtype, tuple(p["split"]) if p["split"] else None), p)
                       for p in entry["pieces"]]

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        if tuple(shape) != self.shape:
            raise CheckpointError(f"{self.key}: the checkpoint holds shape {self.shape}, the model {tuple(shape)}")
        out = torch.empty(hi - lo, dtype=self.dtype)
        covered = 0
        for piece, saved in self.pieces:
            a, b = self._overlap(piece, saved, lo, hi)
            # (slice element, whole element, length) of every run trimmed to whole elements [lo, hi)
            runs = [(local + max(whole, lo) - whole, max(whole, lo), min(whole + n, hi) - max(whole, lo))
                    for local, whole, n in piece.runs(a, b) if whole < hi and whole + n > lo]
            if not runs:
                continue
            first, last = runs[0][0], runs[-1][0] + runs[-1][2]  # read only what the runs span
            data = self.reader.read(saved["file"], self.key, first - saved["lo"], last - saved["lo"])
            for local, whole, n in runs:
                out[whole - lo: whole - lo + n] = data[local - first: local - first + n]
                covered += n
        if covered != hi - lo:
            raise CheckpointError(f"{self.key}: the checkpoint's pieces cover {covered} of elements [{lo}, {hi}) "
                                  "(pieces missing or overlapping)")
        return out

    @staticmethod
    def _overlap(piece: Piece, saved: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
        """The saved piece's slice elements that can fall in whole elements [lo, hi): within the rows
        [lo, hi) spans when the slice is split along an inner dim, all of [saved lo, saved hi) otherwise."""
        a, b = saved["lo"], saved["hi"]
        if not piece.cuts:
            return max(a, lo), min(b, hi)
        if any(len(cut) > 3 and cut[3] > 1 for cut in piece.cuts):  # a fused tensor's blocks: no cheaper bound
            return a, b
        if len(piece.cuts) > 1:  # cut along two dims: the local rows of its outermost cut [lo, hi) can reach
            dim, index, parts = piece.cuts[0]
            inner = math.prod(piece.shape[dim + 1:])
            local_inner = math.prod(piece.local_shape[dim + 1:])
            if dim:  # rows over the dims before it too: no cheaper bound than the whole saved piece
                return a, b
            size = piece.shape[0] // parts
            first = min(max(lo // inner - index * size, 0), size)
            last = min(max(-(-hi // inner) - index * size, 0), size)
            return max(a, first * local_inner), min(b, last * local_inner)
        (dim, _, parts), = piece.cuts
        size, inner = piece.shape[dim], math.prod(piece.shape[dim + 1:])
        local_row, whole_row = size // parts * inner, size * inner
        return max(a, lo // whole_row * local_row), min(b, -(-hi // whole_row) * local_row)


class CheckpointReader:
    """A paratrain.hybrid.materialize Source over a sharded checkpoint: open(name) gives the tensor's
    values by range, read from the files that hold them (each file opened once, read by slices)."""

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        self.folder, self.index = folder, meta["tensors"]
        self._files: dict[str, Any] = {}
        self.bytes_read = 0
        """Bytes of tensor data this reader has read (what a layout needs, not the whole checkpoint)."""

    def keys(self) -> list[str]:
        return list(self.index)

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self.index[key]["dtype"]]

    def open(self, name: str, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> SavedTensor:
        if name not in self.index:
            raise CheckpointError(f"{self.folder} holds no tensor {name!r} (it has {len(self.index)}: a checkpoint "
                                  "of another model?)")
        return SavedTensor(self, name)

    def read(self, file_name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        handle = self._files.get(file_name)
        if handle is None:
            handle = self._files[file_name] = safe_open(str(self.folder / file_name), framework="pt")
        data = handle.get_slice(key)[lo:hi]
        self.bytes_read += data.numel() * data.element_size()
        return data


@torch.no_grad()
def verify_shared(folder: str | Path, *, hint: bool = True) -> dict[str, Any]:
    """verify_checkpoint with the hashing shared out (collective over the world; alone, all of it):
    every rank checks every file's size, tensor headers and the index, and the SHA-256 of every
    world-size-th file from its rank on; then the ranks exchange what they found (one gather, reached
    whatever happened locally), so every rank returns the meta or raises the same CheckpointError,
    naming the file (and, for a bad SHA-256, the rank that found it). Before a load, each rank so reads
    its own pieces plus about 1 / world of the checkpoint, not all of it. hint: name the newest older
    checkpoint that verifies."""
    folder = Path(folder)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    problem: str | None = None
    meta: dict[str, Any] = {}
    try:
        meta = verify_checkpoint(folder, hashed=(), hint=False)
        files = sorted(meta.get("files", {}))
        bad = next((name for name in files[rank::world] if not digest_matches(folder / name, meta["files"][name])), None)
        if bad is not None:
            problem = f"{folder / bad} does not match the SHA-256 written with it (corrupted; found by rank {rank})"
    except (CheckpointError, OSError) as error:  # told to every rank below, never raised alone
        problem = str(error)
    found = [p for p in _gather(problem) if p is not None]
    if found:
        raise CheckpointError(f"{found[0]}; {older_hint(folder)}" if hint else found[0])
    return meta


def newest_shared(root: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest step_* checkpoint under root that verify_shared accepts, with its meta, or None
    (collective: every rank walks rank 0's list of folders and agrees on each)."""
    root = Path(root)
    names = sorted((p.name for p in root.glob("step_*") if p.is_dir()), reverse=True) if root.is_dir() else []
    for name in _gather(names)[0]:
        try:
            return root / name, verify_shared(root / name, hint=False)
        except CheckpointError:
            continue
    return None


def load_sharded(folder: Path, meta: dict[str, Any], view: StateView) -> CheckpointReader:
    """Set an engine's state (`engine.view()`: model, optimizer state, dropout step and loss scale) from
    the verified sharded checkpoint in `folder` (meta: its meta.json), reading only this rank's pieces;
    returns the reader (bytes_read says how much was read)."""
    reader = CheckpointReader(folder, meta)
    try:
        view.load(reader, meta)
    except StateError as error:
        raise CheckpointError(f"{folder}: {error}") from None
    return reader


def checkpoint_to_resume(resume: str, save: str | None) -> tuple[Path, dict[str, Any]] | None:
    """What a run resumes from (collective): 'auto', the newest verified step under `save` (None when
    none verifies); otherwise the checkpoint folder, or root, `resume` names, verified."""
    if resume == "auto":
        return newest_shared(save or "")
    folder = resolve_checkpoint(resume)
    return folder, verify_shared(folder)
