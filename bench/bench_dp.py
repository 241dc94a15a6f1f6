"""paratrain data parallelism vs torch DDP, and gloo all-reduce bandwidth vs our gradient sync.

    python -m bench.bench_dp                 # 2 and 4 processes, about 2 minutes on 2 cores
    python -m bench.bench_dp --worlds 2 --steps 20

Both contenders train the same GPT (4 layers, d_model 256, seq 128, 8 samples per rank, AdamW) from
the same weights on the same batches, with 25 MiB buckets, in the same processes, alternating
rounds so that drift of the machine hits both. Reported: median step time and the ratio
paratrain / DDP (below 1: we are faster). Then the bus bandwidth of one gloo all-reduce of a
bucket-sized tensor, and that of our gradient sync (every bucket of the model, launched back to
back as backward would), and the share of the first that the second reaches.
Bus bandwidth = 2 (n - 1) / n x bytes / time (NCCL-tests' definition for all-reduce).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.world import run_world

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=256)
PER_RANK = 8


def _bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes / seconds


def _race(steps: int, rounds: int, bucket_mb: float) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import paratrain
    from paratrain.config import ModelConfig
    from paratrain.models import lm_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(**MODEL)
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=world, bucket_mb=bucket_mb))
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (PER_RANK, config.seq_len + 1), generator=generator) for _ in range(4)]

    ours = paratrain.parallelize(paratrain.build_gpt(config, seed=0), ctx,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    peer_model = paratrain.build_gpt(config, seed=0)
    peer = DDP(peer_model, process_group=ctx.mesh.group("dp").pg, bucket_cap_mb=bucket_mb)
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-4)

    def step_ours(b):
        ours.train_step((b[:, :-1], b[:, 1:]), lm_loss)

    def step_peer(b):
        logits = peer(b[:, :-1])
        F.cross_entropy(logits.reshape(-1, 256), b[:, 1:].reshape(-1)).backward()
        peer_opt.step()
        peer_opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"paratrain": [], "ddp": []}
    windows, exposed = [], []
    for _ in range(rounds):
        for name, step in (("paratrain", step_ours), ("ddp", step_peer)):
            for i in range(2):  # warm-up
                step(batches[i % 4])
            for i in range(steps):
                dist.barrier()
                started = time.perf_counter()
                step(batches[i % 4])
                times[name].append(time.perf_counter() - started)
                if name == "paratrain":  # the sync of this step, as GradSync ran it
                    sync = ours.grads.times
                    windows.append(sync.reduced - sync.first_launch)
                    exposed.append(sync.reduced - sync.backward_end)

    # one bare gloo all-reduce of the same bytes as the whole gradient
    group = ctx.mesh.group("dp")
    grad_bytes = sum(b.nbytes for b in ours.grads.buckets)
    probe = torch.randn(grad_bytes // 4)
    raw = []
    for _ in range(8):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(probe, group=group.pg)
        raw.append(time.perf_counter() - started)
    raw_s, window_s = statistics.median(raw[2:]), statistics.median(windows)
    return {
        "world": world,
        "params": sum(p.numel() for p in ours.model.parameters()),
        "buckets": len(ours.grads.buckets),
        "grad_MB": grad_bytes / 1e6,
        "paratrain_step_s": statistics.median(times["paratrain"]),
        "ddp_step_s": statistics.median(times["ddp"]),
        "bucket_mb": bucket_mb,
        "bare_s": raw_s,
        "bare_busbw_GBps": _bus_bandwidth(grad_bytes, raw_s, world) / 1e9,
        "window_s": window_s,
        "exposed_s": statistics.median(exposed),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = [run_world(w, _race, args.steps, args.rounds, args.bucket_mb) for w in args.worlds]
    print(f"GPT {MODEL}, {PER_RANK} samples x {MODEL['seq_len']} tokens per rank, AdamW, gloo on CPU; "
          f"bare and sync move the whole gradient ({results[0]['grad_MB']:.1f} MB)")
    print(f"{'procs':>5} {'params':>9} {'buckets':>7} {'paratrain s':>11} {'DDP s':>7} {'ratio':>6} "
          f"{'bare all-reduce':>21} {'sync window':>11} {'exposed':>8} {'exposed / bare':>14}")
    for r in results:
        ratio = r["paratrain_step_s"] / r["ddp_step_s"]
        r.update(ratio=ratio, exposed_over_bare=r["exposed_s"] / r["bare_s"])
        print(f"{r['world']:>5} {r['params'] / 1e6:>8.2f}M {r['buckets']:>7} {r['paratrain_step_s']:>11.3f} "
              f"{r['ddp_step_s']:>7.3f} {ratio:>6.2f} {r['bare_s'] * 1e3:>6.1f} ms {r['bare_busbw_GBps']:>5.2f} GB/s "
              f"{r['window_s'] * 1e3:>8.1f} ms {r['exposed_s'] * 1e3:>5.1f} ms {r['exposed_over_bare']:>14.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
