"""In-memory copies of the asynchronous checkpoints (`--save-mode async --memory-copies K`): a node lost whole
resumes from its peers' RAM, not from disk.

    launcher of node n          Keeper: a server thread holding copies in RAM, for the launcher's lifetime
      worker rank r             its writer process, once rank r's file is written, sends that file's bytes and
                                its share of the index to the keeper of node n and of nodes n+1 .. n+K
    a relaunch (any attempt)    MemoryCopies.newest: the newest step of which every rank's copy is held by a
                                keeper still alive; MemoryCopies.load reads the pieces this rank's layout keeps
                                from the keepers, each file checked against the SHA-256 written with it

A keeper lives in the launcher (`paratrain train` on each node), which outlives its workers: when a worker fails,
the launchers relaunch theirs and the keepers keep what they hold. A node killed whole loses its keeper, but each of
its ranks' copies is also on the K nodes after it, and the other nodes' copies are on their own nodes. Each keeper
holds the newest KEEP steps of each rank it is sent (a relaunch during a save still finds the step before it
complete): in host RAM, (K + 1) x KEEP x the node's checkpoint bytes.

The keepers of a job share a key derived from its rendezvous (multiprocessing.connection's handshake): a guard
against strays on the network, not an authentication. A relaunch resumes from memory when the copy is at least as
new as the newest step folder on disk (the folders are listed, none is read); otherwise from disk as ever.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from pathlib import Path
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors

from paratrain.checkpoint.files import Part, index_document
from paratrain.checkpoint.io import CheckpointError
from paratrain.checkpoint.sharded import CheckpointReader
from paratrain.hybrid.view import StateError, StateView

KEEP = 2
"""Steps of each rank a keeper holds (the newest)."""
ADDRESS = "PARATRAIN_MEMORY_KEEPER"
"""The environment variable a launcher gives its workers: its keeper's HOST:PORT."""
KEY = "PARATRAIN_MEMORY_KEY"
"""The environment variable a launcher gives its workers: the keepers' key (hex)."""
NODE = "GROUP_RANK"
"""torch's elastic agent's variable: this worker's node."""


def job_key(endpoint: str, run_id: str) -> bytes:
    """The key every launcher of one job derives alike (from its rendezvous)."""
    return hashlib.sha256(f"paratrain-memory-copies:{endpoint}:{run_id}".encode()).digest()


def reachable_host(endpoint: str) -> str:
    """This node's address on the interface that reaches the rendezvous endpoint's host (what other nodes can
    connect to); 127.0.0.1 when there is none."""
    host = endpoint.rpartition(":")[0] or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # (no packet is sent: it only picks the route)
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Keeper:
    """The copies one node's launcher holds: {rank: {step: (part, meta, file bytes)}}, the newest KEEP steps of
    each rank; served to every worker of the job (put, inventory, part, file) by a thread per connection."""

    def __init__(self, host: str, key: bytes) -> None:
        self._listener = Listener((host, 0), authkey=key)
        self._copies: dict[int, dict[int, tuple[Part, dict[str, Any], bytes]]] = {}
        self._lock = threading.Lock()
        self._closed = False
        host_, port = self._listener.address
        self.address = f"{host_}:{port}"
        threading.Thread(target=self._accept, daemon=True, name="paratrain-keeper").start()

    def environment(self, key: bytes) -> dict[str, str]:
        """What this node's workers are told (the launcher sets it before it starts them)."""
        return {ADDRESS: self.address, KEY: key.hex()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection = self._listener.accept()
            except (OSError, EOFError):  # closed, or a stray that failed the handshake
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: Connection) -> None:
        with connection:
            try:
                while True:
                    request = connection.recv()
                    connection.send(self._answer(request))
            except (EOFError, OSError):
                return

    def _answer(self, request: tuple[Any, ...]) -> Any:
        kind, *args = request
        with self._lock:
            if kind == "put":
                rank, step, part, meta, data = args
                steps = self._copies.setdefault(rank, {})
                steps[step] = (part, meta, data)
                for old in sorted(steps)[:-KEEP]:
                    del steps[old]
                return "ok"
            if kind == "inventory":  # {step: [ranks]}, and each copy's world
                held: dict[int, list[int]] = {}
                for rank, steps in self._copies.items():
                    for step in steps:
                        held.setdefault(step, []).append(rank)
                return {step: sorted(ranks) for step, ranks in held.items()}
            rank, step = args
            if step not in self._copies.get(rank, {}):
                return Missing(f"the keeper at {self.address} holds no copy of rank {rank}'s step {step} (it keeps "
                               f"the newest {KEEP} of each rank, since its launcher started)")
            part, meta, data = self._copies[rank][step]
            return (part, meta) if kind == "part" else data

    def close(self) -> None:
        self._closed = True
        self._listener.close()


class Missing(str):
    """A keeper's answer for a copy it does not hold."""


def _ask(address: str, key: bytes, *request: Any) -> Any:
    """One request to a keeper; CheckpointError for a copy it does not hold."""
    host, _, port = address.rpartition(":")
    with Client((host, int(port)), authkey=key) as connection:
        connection.send(request)
        answer = connection.recv()
    if isinstance(answer, Missing):
        raise CheckpointError(str(answer))
    return answer


def send_copy(keepers: Sequence[str], key: bytes, *, rank: int, step: int, part: Part, meta: dict[str, Any],
              data: bytes) -> list[str]:
    """In a writer process: rank's file (its bytes) and its share of the index to each keeper; what failed."""
    failed = []
    for address in keepers:
        try:
            _ask(address, key, "put", rank, step, part, meta, data)
        except (OSError, EOFError) as error:
            failed.append(f"{address} ({type(error).__name__}: {error})")
    return failed


def newest_folder_step(root: str) -> int:
    """The newest step_* folder's step under root (listed, not read or verified); -1 when there is none."""
    steps = [int(p.name[5:]) for p in Path(root).glob("step_*") if p.is_dir() and p.name[5:].isdigit()] if root else []
    return max(steps, default=-1)


class MemoryCopies:
    """A worker's view of the job's keepers (collective to build: every rank says its node's keeper)."""

    def __init__(self, copies: int) -> None:
        if ADDRESS not in os.environ:
            raise CheckpointError("memory copies need their launcher's keeper: run under `paratrain train` "
                                  f"(which sets {ADDRESS}), or set train.memory_copies to 0")
        self.key = bytes.fromhex(os.environ[KEY])
        mine = (int(os.environ.get(NODE, "0")), os.environ[ADDRESS])
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, mine)
        by_node = dict(said)
        nodes = sorted(by_node)
        if len(nodes) <= copies:
            raise CheckpointError(f"{copies} memory copies go to {copies} other nodes, and this job has "
                                  f"{len(nodes)} node(s): give --memory-copies {len(nodes) - 1} or fewer")
        at = nodes.index(mine[0])
        self.targets = [by_node[nodes[(at + i) % len(nodes)]] for i in range(copies + 1)]
        """The keepers this rank's copies go to: its own node's, then the next `copies` nodes'."""
        self.keepers = [by_node[n] for n in nodes]

    def newest(self, *, at_least: int) -> tuple[int, dict[int, str]] | None:
        """Collective: the newest step >= at_least of which every rank of the run that saved it has a copy on a
        live keeper, and which keeper holds each rank's; None when there is none."""
        choice: list[Any] = [None]
        if dist.get_rank() == 0:
            holders: dict[int, dict[int, str]] = {}
            for address in self.keepers:
                try:
                    inventory = _ask(address, self.key, "inventory")
                except (OSError, EOFError):  # a keeper gone with its node
                    continue
                for step, ranks in inventory.items():
                    for rank in ranks:
                        holders.setdefault(step, {}).setdefault(rank, address)
            for step in sorted(holders, reverse=True):
                if step < at_least:
                    break
                ranks = holders[step]
                try:
                    world = _ask(ranks[0], self.key, "part", 0, step)[1]["world"] if 0 in ranks else -1
                except (CheckpointError, OSError, EOFError):  # gone meanwhile: an older step, or disk
                    continue
                if world > 0 and all(r in ranks for r in range(world)):
                    choice[0] = (step, ranks)
                    break
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(self, step: int, holders: dict[int, str], view: StateView) -> dict[str, Any]:
        """Collective: the engine's state set from the copies of `step` (rank 0 gathers the index's shares and
        sends the document to every rank; each reads only the files its pieces need); returns the meta."""
        found: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                meta = _ask(holders[0], self.key, "part", 0, step)[1]
                parts = [_ask(holders[r], self.key, "part", r, step)[0] for r in range(meta["world"])]
                found[0] = json.loads(json.dumps(index_document(step, parts, meta["meta"], {}), sort_keys=True))
                # (as meta.json reads back)
            except (CheckpointError, OSError, EOFError) as error:  # told to every rank, raised by each
                found[0] = Missing(f"the memory copies of step {step}: {error}")
        dist.broadcast_object_list(found, src=0)
        document = found[0]
        if isinstance(document, Missing):
            raise CheckpointError(str(document))
        files = {name: holders[_rank_of(name)] for name in document["files"]}
        reader = MemoryReader(document, files, self.key, step)
        try:
            view.load(reader, document)
        except StateError as error:
            raise CheckpointError(f"the memory copies of step {step}: {error}") from None
        return document


def _rank_of(file_name: str) -> int:
    """The rank whose file this is (paratrain.checkpoint.files names them rank-RRRRR.safetensors)."""
    return int(file_name.split("-")[1].split(".")[0])


class MemoryReader(CheckpointReader):
    """CheckpointReader over the keepers' copies: each file fetched once, when a piece needs it, and checked
    against the SHA-256 its writer took."""

    def __init__(self, document: dict[str, Any], files: dict[str, str], key: bytes, step: int) -> None:
        super().__init__(folder=None, meta=document)  # type: ignore[arg-type]
        self.document, self.files, self.key, self.step = document, files, key, step
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}

    def read(self, file_name: str, key: str, lo: int, hi: int) -> torch.Tensor:
        tensors = self._loaded.get(file_name)
        if tensors is None:
            data = _ask(self.files[file_name], self.key, "file", _rank_of(file_name), self.step)
            if hashlib.sha256(data).hexdigest() != self.document["files"][file_name]["sha256"]:
                raise CheckpointError(f"the memory copy of {file_name} (step {self.step}, keeper "
                                      f"{self.files[file_name]}) does not match the SHA-256 written with it")
            tensors = self._loaded[file_name] = load_safetensors(data)
        data = tensors[key][lo:hi]
        self.bytes_read += data.numel() * data.element_size()
        return data
