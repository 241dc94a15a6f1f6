"""Run a function on N fresh gloo processes: the tests' rank pool (tests/pool.py: spawned workers meeting
through a file store, one thread each, every rank's error named), started for one call. Run benchmarks
from the repository's root as modules (`python -m bench.bench_dp`), so that `bench` and `tests` import."""

from __future__ import annotations

from typing import Any, Callable

from tests.pool import RankPool


def run_world(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on `world` fresh ranks; rank 0's result (a failure names every failing rank)."""
    pool = RankPool(world, collective_timeout_s=300.0)
    try:
        return pool.run(fn, *args, timeout=1800.0)[0]
    finally:
        pool.close()


def without_missing(contenders: list[str], package: str = "deepspeed") -> list[str]:
    """The contenders, less those named after `package` when it is not installed (said once)."""
    try:
        __import__(package)
    except ImportError:
        print(f"{package} is not installed: its contenders are skipped (bench/bench_zero.py's docstring says how "
              "to install it)")
        return [c for c in contenders if not c.startswith(package)]
    return contenders


def median_step_seconds(engine: Any, batch: Any, loss_fn: Callable[..., Any], steps: int, warmup: int = 2) -> float:
    """The median time of `steps` engine.train_step calls on one batch, after `warmup` untimed ones."""
    import statistics
    import time

    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        engine.train_step(batch, loss_fn)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def contest_arguments(description: str, contenders: list[str], *, worlds: list[int], steps: int,
                      argv: list[str] | None) -> Any:
    """A benchmark's command line: --worlds, --steps, --only (the contenders; those of a missing package dropped,
    said once), --json."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--worlds", type=int, nargs="+", default=worlds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--only", nargs="+", default=contenders, choices=contenders)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    args.only = without_missing(args.only)
    return args


def barrier_step_seconds(step: Callable[[Any], Any], batches: list[Any], steps: int, warmup: int = 2) -> float:
    """The median seconds of `steps` calls step(batch) (cycling through `batches`) after `warmup` untimed ones, the
    ranks meeting at a barrier before each."""
    import statistics
    import time

    import torch.distributed as dist

    times = []
    for i in range(steps + warmup):
        dist.barrier()
        started = time.perf_counter()
        step(batches[i % len(batches)])
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)
