"""A pool of rank processes kept alive across tests (docs/testing.md).

Spawning a gloo world costs seconds (an interpreter and `import torch` per rank); one small parity
test on a live world costs milliseconds. So each world size gets one pool of `spawn`ed workers that
meet through a file store (no ports, so no address-in-use retries), and each test sends it a job: an importable module-level function run on
every rank, whose per-rank results come back. Any error or timeout kills the pool (a rank stuck in
a collective must not leak into the next test), and the next test builds a fresh one. This works
because paratrain keeps no global process-group state: a job builds the Mesh it needs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


def _worker(rank: int, world_size: int, store: str, conn: Any, collective_timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            result = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            result = ("error", traceback.format_exc())
        _release_groups()
        conn.send(result)
    dist.destroy_process_group()
    conn.send(("closed", None))
    os._exit(0)


def _release_groups() -> None:
    """Destroy the process groups a job created (its Mesh's; a job need not close its Context), keeping the world's:
    each gloo group holds threads and sockets, and a pool runs hundreds of jobs. The groups' objects, and their
    threads, go with the job's engine and mesh (paratrain.comm.hooks: no gradient hook keeps them alive)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()  # the job's engine and mesh hold the groups in reference cycles: their threads end with them


class RankPool:
    def __init__(self, world_size: int, *, start_timeout: float = 120.0, collective_timeout_s: float = 60.0) -> None:
        """collective_timeout_s: how long a rank's collective waits for its peers (the benchmarks, whose
        ranks may build a large model while others wait, give more)."""
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix=f"paratrain-pool{world_size}-")
        context = mp.get_context("spawn")
        self._conns, self._procs = [], []
        store = os.path.join(self._dir.name, "store")
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(rank, world_size, store, child, collective_timeout_s), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start", start_timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """fn(*args, **kwargs) on every rank; returns the results by rank, or raises naming the ranks."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        errors, silent = [], []
        for rank, conn in enumerate(self._conns):
            if not self._wait_for(rank, deadline):
                silent.append(rank)
                continue
            try:
                status, payload = conn.recv()
            except EOFError:
                silent.append(rank)
                continue
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{payload}")
            results[rank] = payload
        if errors or silent:
            self.close()
            lines = [f"job {what!r} on {self.world_size} ranks failed"]
            if silent:
                lines.append(f"ranks {silent} did not answer within {timeout:.0f}s (stuck or dead)")
            raise AssertionError("\n".join(lines + errors))
        return results

    def _wait_for(self, rank: int, deadline: float) -> bool:
        """True when rank has answered; False at the deadline or as soon as its process is dead."""
        conn, proc = self._conns[rank], self._procs[rank]
        while time.monotonic() < deadline:
            if conn.poll(0.2):
                return True
            if not proc.is_alive():
                return conn.poll(0)
        return False

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs = [], []
        self._dir.cleanup()


class Pools:
    """One live pool per world size asked for, kept between tests: a pool whose ranks wait for their next job
    costs no CPU (each rank blocks in a pipe read), only memory (a few hundred MB per rank), and a suite that
    moved between sizes spent 80 s restarting pools (measured: 68 starts). A pool that failed is replaced."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is not None and not pool.alive:
            pool.close()
            pool = None
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def drop(self, world_size: int) -> None:
        """Close the pool of this size (a world left unusable); the next call for the size starts a fresh one."""
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
