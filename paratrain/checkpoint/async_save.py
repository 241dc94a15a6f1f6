"""Asynchronous sharded checkpoints (`--save-mode async`): the step waits only for a copy.

    saver = AsyncSaver()
    saver.save(root, step, engine.view(), meta)     # collective: copies this rank's pieces, then returns
    ...                                             # training goes on while a writer process writes them
    saver.close()                                   # the last one written and published

At a step boundary every rank copies its pieces (paratrain.checkpoint.sharded's, the same files) into one host
buffer in shared memory (a file under /dev/shm mapped by both processes), kept from one save to the next: the only
part the step waits for. A writer process of its own (`python -m paratrain.checkpoint.writer`, not a thread:
the step's Python never shares the interpreter lock with hashing and writing; told each job as a JSON line) writes them
into the step's temporary folder, fsyncs them, takes their SHA-256 and leaves its share of the index beside them
(`part-RRRRR.json`); rank 0's writer waits for every rank's share, writes meta.json and publishes the folder as a
synchronous save does (renames, then `latest`). The bytes are the synchronous save's: weights changed after the
copy cannot reach them. A new save first waits for the previous one, so one checkpoint is in flight at a time.

A writer that dies (killed, a full disk) publishes nothing: `latest` still names the previous checkpoint, complete
and verified. The rank whose writer died says so at its next save (or at close) and leaves a `rank-RRRRR.failed`
marker in the folder, so that rank 0's writer stops waiting for it; a fresh writer takes the next save.
"""

from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from paratrain.checkpoint.io import CheckpointError, _fsync_write, _publish
from paratrain.checkpoint.sharded import local_state, prepare_folder, write_index, write_rank_file
from paratrain.hybrid.view import DTYPES, StateView, dtype_name

PARTS_TIMEOUT_S = 1800.0
"""How long rank 0's writer waits for the other ranks' shares before it gives the checkpoint up."""
ALIGN = 64
"""Bytes each staged tensor starts on a multiple of."""
REPLY = "paratrain-writer: "
"""What the writer's replies start with (anything else it prints is not one)."""


def _tmp(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step_{step:08d}"


def write(job: dict[str, Any]) -> None:
    """One job, in the writer process: this rank's file and its share of the index; on rank 0, once every
    rank's share is there, meta.json and the publish."""
    tmp = _tmp(job["root"], job["step"])
    rank, step = job["rank"], job["step"]
    if job["delay_s"]:
        time.sleep(job["delay_s"])
    _check_trainer(job)
    buffer = torch.from_file(job["buffer"], shared=True, size=job["bytes"], dtype=torch.uint8)
    tensors = {key: buffer[at: at + math.prod(shape) * DTYPES[dtype].itemsize].view(DTYPES[dtype]).view(shape)
               for key, dtype, shape, at in job["tensors"]}
    files = write_rank_file(tmp, rank, tensors, job["index"])
    part = tmp / f"part-{rank:05d}.json"
    _fsync_write(part.with_suffix(".tmp"), json.dumps([files, job["index"], job["scalars"], job["groups"]]))
    os.replace(part.with_suffix(".tmp"), part)
    if rank != 0:
        return
    parts, started = [], time.monotonic()
    for r in range(job["world"]):
        path = tmp / f"part-{r:05d}.json"
        while not path.exists():
            if (tmp / f"rank-{r:05d}.failed").exists():
                raise CheckpointError(f"rank {r}'s checkpoint writer died writing step {step}: not published")
            _check_trainer(job)
            if time.monotonic() - started > PARTS_TIMEOUT_S:
                raise CheckpointError(f"rank {r}'s share of step {step} did not arrive in {PARTS_TIMEOUT_S:.0f} s: "
                                      "not published")
            time.sleep(0.02)
        parts.append(tuple(json.loads(path.read_text())))
    for r in range(job["world"]):
        (tmp / f"part-{r:05d}.json").unlink()
    write_index(tmp, step, parts, job["meta"], job["attachments"])
    _publish(Path(job["root"]), tmp, f"step_{step:08d}", keep_last=job["keep_last"])


def _check_trainer(job: dict[str, Any]) -> None:
    """A writer whose trainer is gone (killed with its job) stops: a restarted job reuses the folder names."""
    if os.getppid() != job["trainer"]:
        raise CheckpointError(f"rank {job['rank']}'s trainer (pid {job['trainer']}) is gone: step {job['step']} "
                              "not published")


def main() -> None:
    """The writer: a job a line on stdin, a reply a line on stdout ({"step", "error"}), until stdin closes."""
    torch.set_num_threads(1)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            write(job)
            error = None
        except BaseException as failed:  # said to the trainer at its next save
            error = f"{type(failed).__name__}: {failed}"
        print(REPLY + json.dumps({"step": job["step"], "error": error}), flush=True)


class AsyncSaver:
    """save_sharded's checkpoints, written by a writer process of this rank while training goes on."""

    def __init__(self, *, delay_s: float = 0.0, staging_dir: str | None = None) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._unread = b""
        self._pending: tuple[str, int, int] | None = None  # (root, step, rank) in flight
        self._dir = staging_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self._buffer: tuple[str, int] | None = None  # (path, bytes) of the staging file
        self._count = 0
        self.delay_s = delay_s
        """Tests: the writer sleeps this long before writing (a writer to kill mid-write)."""
        self.blocked_s = 0.0
        """Seconds the last save kept the step waiting (the previous save's end, the folder, the copy)."""
        self._start()  # its imports run while training starts, not at the first save

    @property
    def writer_pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def save(self, root: str | Path, step: int, view: StateView, meta: dict[str, Any], *, keep_last: int = 0,
             attachments: Mapping[str, str | Path] | None = None,
             before_publish: Callable[[], None] | None = None) -> Path:
        """Collective, as save_sharded: the previous save waited for (its failure raised: CheckpointError), this
        rank's pieces copied, the writing handed over; returns the folder the checkpoint will be published as."""
        started = time.perf_counter()
        self.wait()
        rank = view.mesh.rank
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        prepare_folder(root, step, rank)
        local = local_state(view)
        job = {"root": str(root), "step": step, "rank": rank, "world": world, "trainer": os.getpid(),
               **self._stage(local.tensors),
               "index": local.index, "scalars": local.scalars, "groups": local.groups, "keep_last": keep_last,
               "delay_s": self.delay_s, "meta": {**meta, **view.scalars()} if rank == 0 else {},
               "attachments": {k: str(v) for k, v in (attachments or {}).items()} if rank == 0 else {}}
        process = self._start()
        assert process.stdin is not None
        process.stdin.write((json.dumps(job) + "\n").encode())
        process.stdin.flush()
        self._pending = (str(root), step, rank)
        self.blocked_s = time.perf_counter() - started
        if before_publish is not None:
            before_publish()
        return Path(root) / f"step_{step:08d}"

    def _stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy the tensors into the staging file (a new one when they no longer fit); where each lies."""
        placed, at = [], 0
        for key, tensor in tensors.items():
            placed.append([key, dtype_name(tensor.dtype), list(tensor.shape), at])
            at += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        size = max(at, ALIGN)
        if self._buffer is None or self._buffer[1] < size:
            self._drop_buffer()
            self._count += 1
            path = os.path.join(self._dir, f"paratrain-stage-{os.getpid()}-{self._count}")
            self._buffer = (path, size)
        path, size = self._buffer
        buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for (_, _, _, offset), tensor in zip(placed, tensors.values()):
            nbytes = tensor.numel() * tensor.element_size()
            buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return {"buffer": path, "bytes": size, "tensors": placed}

    def _drop_buffer(self) -> None:
        if self._buffer is not None and os.path.exists(self._buffer[0]):
            os.unlink(self._buffer[0])
        self._buffer = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._unread = b""
            self._process = subprocess.Popen([sys.executable, "-m", "paratrain.checkpoint.writer"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        return self._process

    def wait(self) -> None:
        """Until the save in flight is written (on rank 0: published). CheckpointError if it failed or its writer
        died; the next save starts a fresh writer."""
        if self._pending is None:
            return
        root, step, rank = self._pending
        self._pending = None
        process = self._process
        assert process is not None and process.stdout is not None
        while True:
            reply = self._reply(process)
            if reply is not None:
                break
            if process.poll() is not None:
                self._process = None
                tmp = _tmp(root, step)
                if tmp.is_dir():  # rank 0's writer stops waiting for this rank's share
                    _fsync_write(tmp / f"rank-{rank:05d}.failed", f"exit code {process.returncode}\n")
                raise CheckpointError(f"rank {rank}'s checkpoint writer died (exit code {process.returncode}) "
                                      f"writing step {step}: that checkpoint is not published; `latest` under {root} "
                                      "still names the previous one")
        if reply["error"] is not None:
            raise CheckpointError(f"rank {rank}'s checkpoint writer failed on step {reply['step']}: {reply['error']}")

    def _reply(self, process: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        """The writer's reply, if one arrives within half a second (read from the pipe's descriptor itself:
        nothing waits in a Python buffer that select cannot see)."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        deadline = time.monotonic() + 0.5
        while b"\n" not in self._unread:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the writer closed its end
                return None
            self._unread += chunk
        while b"\n" in self._unread:
            line, self._unread = self._unread.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith(REPLY):
                return json.loads(text[len(REPLY):])
        return None

    def abort(self) -> None:
        """The writer killed and the staging file removed, a save in flight given up (its folder stays
        unpublished: `latest` names the previous checkpoint)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process, self._pending = None, None
        self._drop_buffer()

    def close(self) -> None:
        """The save in flight finished, the writer stopped, the staging file removed."""
        try:
            self.wait()
        finally:
            if self._process is not None:
                if self._process.poll() is None and self._process.stdin is not None:
                    self._process.stdin.close()
                    self._process.wait(timeout=30)
                self._process = None
            self._drop_buffer()
