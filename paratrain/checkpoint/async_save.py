"""Asynchronous sharded checkpoints (`--save-mode async`): the step waits only for a copy.

    saver = AsyncSaver()
    saver.save(root, step, engine.view(), meta)     # collective: copies this rank's pieces, then returns
    ...                                             # training goes on while a writer process writes them
    saver.close()                                   # the last one written and published

At a step boundary every rank copies its pieces (paratrain.checkpoint.sharded's, the same files) into one host
buffer of shared memory (an anonymous memory file both processes map; on systems without one, a file in the
temporary folder), kept from one save to the next: the only part the step waits for. A writer process of its own
(`python -m paratrain.checkpoint.writer`, not a thread: the step's Python never shares the interpreter lock with
hashing and writing; told each job as a JSON line) writes them into the step's temporary folder, fsyncs them, takes
their SHA-256 and leaves its share of the index beside them (`part-RRRRR.json`); rank 0's writer waits for every
rank's share, writes meta.json and publishes the folder as a synchronous save does (renames, then `latest`). The
bytes are the synchronous save's (the index's keys are strings, so its JSON round trip keeps their order): weights
changed after the copy cannot reach them. A new save first waits for the previous one: one checkpoint in flight.

A writer that fails (a full disk) or dies (killed) publishes nothing: `latest` still names the previous checkpoint,
complete and verified. It leaves a `rank-RRRRR.failed` marker in the step's folder (its trainer does, for a writer
that died), so that rank 0's writer stops waiting for that share; the rank says so at its next save, and a fresh
writer takes over where one died. A writer whose trainer is gone stops. The staging memory costs the rank's
checkpoint bytes in host RAM for the whole run.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from paratrain.checkpoint.io import CheckpointError, _fsync_write, _publish
from paratrain.checkpoint.files import write_index, write_rank_file
from paratrain.checkpoint.memory_copies import MemoryCopies, send_copy
from paratrain.checkpoint.sharded import local_state, prepare_folder
from paratrain.checkpoint.staging import Staging
from paratrain.hybrid.view import DTYPES, StateView, dtype_name

PARTS_TIMEOUT_S = 1800.0
"""How long rank 0's writer waits for the other ranks' shares before it gives the checkpoint up."""
ALIGN = 64
"""Bytes each staged tensor starts on a multiple of."""
REPLY = "paratrain-writer: "
"""What the writer's replies start with (anything else it prints is not one)."""


def _tmp(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-step_{step:08d}"


def _failed(root: str | Path, step: int, rank: int, why: str) -> None:
    """Mark this rank's share of the step as never coming (rank 0's writer stops waiting for it)."""
    tmp = _tmp(root, step)
    if tmp.is_dir():
        _fsync_write(tmp / f"rank-{rank:05d}.failed", why + "\n")


def write(job: dict[str, Any]) -> list[str]:
    """One job, in the writer process: this rank's file and its share of the index (and their copies to the
    keepers of job["keepers"]: paratrain.checkpoint.memory_copies); on rank 0, once every rank's share is there,
    meta.json and the publish. A failure before this rank's share is there leaves the marker. Returns the
    keepers the copies did not reach (the checkpoint on disk does not wait for them)."""
    tmp, rank, step = _tmp(job["root"], job["step"]), job["rank"], job["step"]
    try:
        if job["delay_s"]:
            time.sleep(job["delay_s"])
        buffer = torch.from_file(job["buffer"], shared=True, size=job["bytes"], dtype=torch.uint8)
        tensors = {key: buffer[at: at + math.prod(shape) * DTYPES[dtype].itemsize].view(DTYPES[dtype]).view(shape)
                   for key, dtype, shape, at in job["tensors"]}
        files = write_rank_file(tmp, rank, tensors, job["index"])
        _check_trainer(job)
        part = tmp / f"part-{rank:05d}.json"
        _fsync_write(part.with_suffix(".tmp"), json.dumps([files, job["index"], job["scalars"], job["groups"]]))
        os.replace(part.with_suffix(".tmp"), part)
    except BaseException as error:
        _failed(job["root"], step, rank, f"{type(error).__name__}: {error}")
        raise
    missed = []
    if job.get("keepers"):  # the same file's bytes and share of the index, to the keepers (memory_copies)
        data = b"".join((tmp / name).read_bytes() for name in files)
        missed = send_copy(job["keepers"], bytes.fromhex(job["key"]), rank=rank, step=step,
                           part=(files, job["index"], job["scalars"], job["groups"]),
                           meta={"world": job["world"], "meta": job["meta"]}, data=data)
    if rank == 0:
        _publish_when_complete(job)
    return missed


def _publish_when_complete(job: dict[str, Any]) -> None:
    """Rank 0's writer: once every rank's share is there, meta.json and the publish."""
    tmp, step = _tmp(job["root"], job["step"]), job["step"]
    parts, started = [], time.monotonic()
    for r in range(job["world"]):
        path = tmp / f"part-{r:05d}.json"
        while not path.exists():
            if (tmp / f"rank-{r:05d}.failed").exists():
                why = (tmp / f"rank-{r:05d}.failed").read_text().strip()
                raise CheckpointError(f"rank {r}'s checkpoint writer did not write step {step} ({why}): not "
                                      "published")
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
        missed: list[str] = []
        try:
            missed = write(job)
            error = None
        except BaseException as failed:  # said to the trainer at its next save
            error = f"{type(failed).__name__}: {failed}"
        print(REPLY + json.dumps({"step": job["step"], "error": error, "missed": missed}), flush=True)


class AsyncSaver:
    """save_sharded's checkpoints, written by a writer process of this rank while training goes on."""

    def __init__(self, *, delay_s: float = 0.0) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._unread = b""
        self._pending: tuple[str, int, int] | None = None  # (root, step, rank) in flight
        self._staging: Staging | None = None
        self.delay_s = delay_s
        """Tests: the writer sleeps this long before writing (a writer to kill mid-write)."""
        self.missed: list[str] = []
        """The keepers the last save's memory copies did not reach (said by wait; the checkpoint on disk is not
        affected)."""
        self.blocked_s = 0.0
        """Seconds the last save kept the step waiting (the previous save's end, the folder, the copy). The writer
        starts with the first save (handed the staging memory); its imports overlap that save's writing."""

    @property
    def writer_pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def save(self, root: str | Path, step: int, view: StateView, meta: dict[str, Any], *, keep_last: int = 0,
             attachments: Mapping[str, str | Path] | None = None,
             before_publish: Callable[[], None] | None = None, copies: MemoryCopies | None = None) -> Path:
        """Collective, as save_sharded: the previous save waited for (its failure raised: CheckpointError), this
        rank's pieces copied, the writing handed over; returns the folder the checkpoint will be published as.
        before_publish runs once the copy is handed over (the files may not be written yet). copies: the writer
        also sends the rank's file to these keepers (paratrain.checkpoint.memory_copies)."""
        started = time.perf_counter()
        self.wait()
        rank = view.mesh.rank
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        prepare_folder(root, step, rank)
        local = local_state(view, to_cpu=False)  # copied once, from where they are into the staging memory
        job = {"root": str(root), "step": step, "rank": rank, "world": world, "trainer": os.getpid(),
               **self._stage(local.tensors),
               "index": local.index, "scalars": local.scalars, "groups": local.groups, "keep_last": keep_last,
               "delay_s": self.delay_s, "meta": {**meta, **view.scalars()} if rank == 0 else {},
               "attachments": {k: str(v) for k, v in (attachments or {}).items()} if rank == 0 else {},
               **({"keepers": copies.targets, "key": copies.key.hex()} if copies is not None else {})}
        line = (json.dumps(job) + "\n").encode()
        for attempt in (0, 1):  # a writer that died since the last save: a fresh one
            process = self._start()
            assert process.stdin is not None
            try:
                process.stdin.write(line)
                process.stdin.flush()
                break
            except BrokenPipeError:
                self._process = None
                if attempt:
                    raise CheckpointError(f"rank {rank}'s checkpoint writer could not be started") from None
        self._pending = (str(root), step, rank)
        self.blocked_s = time.perf_counter() - started
        if before_publish is not None:
            before_publish()
        return Path(root) / f"step_{step:08d}"

    def _stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy the tensors into the staging memory (a larger one, and a writer that maps it, when they no longer
        fit); where each lies."""
        placed, at = [], 0
        for key, tensor in tensors.items():
            placed.append([key, dtype_name(tensor.dtype), list(tensor.shape), at])
            at += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        size = max(at, ALIGN)
        if self._staging is None or self._staging.size < size:
            self._stop_writer()  # idle (waited for): the next one is handed the new memory
            if self._staging is not None:
                self._staging.close()
            self._staging = Staging(size)
        buffer = self._staging.mapped
        for (_, _, _, offset), tensor in zip(placed, tensors.values()):
            nbytes = tensor.numel() * tensor.element_size()
            buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return {"buffer": self._staging.path, "bytes": self._staging.size, "tensors": placed}

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._unread = b""
            fds = (self._staging.fd,) if self._staging is not None and self._staging.fd is not None else ()
            self._process = subprocess.Popen([sys.executable, "-m", "paratrain.checkpoint.writer"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=fds,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        return self._process

    def wait(self) -> None:
        """Until the save in flight is written (on rank 0: published). CheckpointError if it failed or its writer
        died; the next save starts a fresh writer."""
        if self._pending is None:
            return
        root, step, rank = self._pending
        process = self._process
        assert process is not None and process.stdout is not None
        while True:
            reply = self._reply(process)
            if reply is not None and reply["step"] == step:
                break
            if reply is None and process.poll() is not None:
                self._pending, self._process = None, None
                _failed(root, step, rank, f"its writer died, exit code {process.returncode}")
                raise CheckpointError(f"rank {rank}'s checkpoint writer died (exit code {process.returncode}) "
                                      f"writing step {step}: that checkpoint is not published; `latest` under {root} "
                                      "still names the previous one")
        self._pending = None
        self.missed = reply.get("missed", [])
        if reply["error"] is not None:
            raise CheckpointError(f"rank {rank}'s checkpoint writer failed on step {step}: {reply['error']}")

    def _reply(self, process: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        """The writer's next reply, if one arrives within half a second (read from the pipe's descriptor itself:
        nothing waits in a Python buffer the selector cannot see)."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        deadline = time.monotonic() + 0.5
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._unread:
                    line, self._unread = self._unread.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(REPLY):
                        return json.loads(text[len(REPLY):])
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:  # the writer closed its end: it is ending
                    try:
                        process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                    return None
                self._unread += chunk

    def _stop_writer(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def abort(self) -> None:
        """The writer killed and the staging memory released, a save in flight given up (its folder stays
        unpublished: `latest` names the previous checkpoint)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if self._pending is not None:
            _failed(*self._pending, "its trainer gave it up")
        self._process, self._pending = None, None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def close(self) -> None:
        """The save in flight finished (its failure raised: CheckpointError), the writer stopped, the staging
        memory released."""
        try:
            self.wait()
        finally:
            self._stop_writer()
            if self._staging is not None:
                self._staging.close()
                self._staging = None
