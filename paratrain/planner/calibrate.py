"""`paratrain plan --calibrate`: the `cpu` hardware profile, measured on this machine.

Ranks on a CPU run one thread each (as the launcher starts them), so every figure is per process:
    peak_flops      float32 matmul FLOP/s of one thread (a 512 x 512 x 512 product, best of several)
    efficiency      the FLOP/s that a training step reaches (forward, backward, AdamW; one process)
    overhead_s      and its fixed time per block and micro-batch (launches, Python): the two solve
                    time = FLOPs / (peak x efficiency) + overhead x blocks x micro-batches for the
                    tiny and the small GPT (one micro-batch of 8 each); efficiency is the rate over
                    the matmul peak
    moe_overhead_s  what a MoE layer adds per micro-batch: the tiny-moe GPT's step time beyond the two
                    terms above, per MoE layer
    intra_node_bw   gloo all-reduce bus bandwidth between `processes` local processes (16 MiB)
    latency_s       the time of a 4-byte gloo all-reduce between them
    memory_bytes    the memory available now, shared by `processes` processes
inter_node_bw is the same loopback figure: a network between machines is not measured here (give
--inter-node-gbps). About 10 seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paratrain.planner.hardware import Hardware

def _best_seconds(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_flops(size: int = 512, repeats: int = 10) -> float:
    """float32 FLOP/s of one thread on a size^3 matmul (best of `repeats`)."""
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    b = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
    a @ b  # warm up
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats)


def step_seconds(name: str, steps: int = 4) -> tuple[float, float, int]:
    """(seconds, model FLOPs, blocks) of a training step of a GPT preset on one process, one
    micro-batch of 8: the median of `steps` steps after a first one."""
    from paratrain.config import preset
    from paratrain.hybrid import EngineOptions, parallelize
    from paratrain.models import build_gpt, lm_loss
    from paratrain.topology import init

    config = preset(name)
    ctx = init(device="cpu")
    model = build_gpt(config, seed=0)
    engine = parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                         options=EngineOptions(micro_batch=8))
    x = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = (x[:, :-1], x[:, 1:])
    engine.train_step(batch, lm_loss)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_step(batch, lm_loss)
        times.append(time.perf_counter() - start)
    flops = config.flops_per_token(config.seq_len) * x.shape[0] * config.seq_len
    return statistics.median(times), flops, config.n_layer


def compute_rate(small: tuple[float, float, int], large: tuple[float, float, int]) -> tuple[float, float]:
    """(FLOP/s, seconds per block and micro-batch) solving t = F / rate + overhead x blocks for two
    measured steps (one micro-batch each); overhead 0 (and the larger model's rate) if the two do not
    give a positive one."""
    (t1, f1, b1), (t2, f2, b2) = small, large
    per_flop = (t2 * b1 - t1 * b2) / (f2 * b1 - f1 * b2) if f2 * b1 != f1 * b2 else 0.0
    overhead = (t1 - f1 * per_flop) / b1 if per_flop > 0 else -1.0
    if per_flop <= 0 or overhead < 0:
        return f2 / t2, 0.0
    return 1.0 / per_flop, overhead


def _gloo_rank(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        big, small = torch.zeros(4 * 2**20), torch.zeros(1)  # 16 MiB, 4 bytes
        for _ in range(2):
            dist.all_reduce(big)
            dist.all_reduce(small)
        dist.barrier()
        big_s = _best_seconds(lambda: dist.all_reduce(big), 5)
        small_s = _best_seconds(lambda: dist.all_reduce(small), 20)
        if rank == 0:
            bus = 2 * (world - 1) / world * big.numel() * 4 / big_s
            Path(out).write_text(f"{bus} {small_s}")
    finally:
        dist.destroy_process_group()


def gloo_bandwidth(processes: int = 2) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of gloo all-reduces between local processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_gloo_rank, args=(processes, os.path.join(tmp, "store"), out), nprocs=processes,
                           start_method="spawn")
        bus, latency = map(float, Path(out).read_text().split())
    return bus, latency


def available_memory() -> float:
    """MemAvailable of /proc/meminfo, bytes (Linux); else the total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(processes: int = 2) -> Hardware:
    """Measure this machine (one thread per process, as ranks run) and return its `cpu` profile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = matmul_flops()
        reached, overhead = compute_rate(step_seconds("tiny"), step_seconds("small"))
        moe_time, moe_flops, moe_blocks = step_seconds("tiny-moe")
        moe_overhead = max(0.0, moe_time - moe_flops / reached - overhead * moe_blocks) / _moe_layers("tiny-moe")
    finally:
        torch.set_num_threads(threads)
    bus, latency = gloo_bandwidth(processes)
    return Hardware("cpu", peak_flops=peak, memory_bytes=available_memory() / processes, intra_node_bw=bus,
                    inter_node_bw=bus, devices_per_node=os.cpu_count() or processes,
                    efficiency=min(1.0, reached / peak), latency_s=latency, overhead_s=overhead,
                    moe_overhead_s=moe_overhead)


def ensure_cpu_profile() -> None:
    """Measure and save this machine's `cpu` profile (hardware.CPU_PROFILE) if none is saved yet, saying so in one
    line: `--plan auto` and `paratrain plan --hardware cpu` then need no separate `paratrain plan --calibrate`."""
    from paratrain.planner.hardware import CPU_PROFILE as path  # read when asked: a test may point it elsewhere
    if path.exists():
        return
    print(f"paratrain: no CPU profile at {path}: measuring this machine once (about 10 s; "
          "`paratrain plan --calibrate` measures it again)", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibrate().to_dict(), indent=1) + "\n")


def _moe_layers(name: str) -> int:
    from paratrain.config import preset

    return preset(name).moe_layers
