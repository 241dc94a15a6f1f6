"""Run a function on N fresh gloo processes (spawned, meeting through a file store); rank 0's result."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        result = fn(*args)
        if rank == 0:
            queue.put(("ok", result))
    except BaseException as error:  # noqa: BLE001
        queue.put(("error", f"rank {rank}: {error!r}"))
        raise
    finally:
        dist.destroy_process_group()
        queue.close()
        queue.join_thread()  # the result must leave through the feeder thread before os._exit
    os._exit(0)


def run_world(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), fn, args, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        status, payload = queue.get(timeout=1800)
        for proc in procs:
            proc.join(timeout=60)
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def without_missing(contenders: list[str], package: str = "deepspeed") -> list[str]:
    """The contenders, less those named after `package` when it is not installed (said once)."""
    try:
        __import__(package)
    except ImportError:
        print(f"{package} is not installed: its contenders are skipped (bench/bench_zero.py's docstring says how "
              "to install it)")
        return [c for c in contenders if not c.startswith(package)]
    return contenders
