"""Context parallelism: step time and saved activations per rank against the sequence length, for cp 1 / 2 / 4
and ring attention vs Ulysses vs USP (Ulysses over 2 ranks, a ring across; cp 4 and up), on the same GPT.

    python -m bench.bench_cp --json bench/results/cpu-cp.json   # about 6 minutes on 2 cores
    python -m bench.bench_cp --seq 512 --cp 2 --steps 2

Every contender trains the same GPT (2 layers, d_model 256, 8 heads, 2 samples of `seq` tokens, AdamW) from the
same weights in fresh processes (dp = 1: the cp ranks split every sequence). Reported for rank 0: median step
time; "activations", the bytes autograd saves for backward in one forward (paratrain.memory.saved_activations,
parameters left out), which context parallelism divides by cp; "step peak", how far the process's address space
grows over the steps (VmPeak less VmSize before them, with big allocations mmapped and one malloc arena, so that
it follows the live tensors: saved activations, the ring's blocks, Ulysses' buffers, gradients and optimizer
state); "live tensors", every tensor storage alive after the timed steps. torch's own context_parallel (torch.distributed.tensor.experimental) raises NotImplementedError
for causal attention on CPU with gloo, so there is no peer to race here; on a GPU it would be one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.bench_zero import _live_tensor_mb
from bench.world import run_world

MODEL = {"vocab_size": 256, "n_layer": 2, "n_head": 8, "d_model": 256}
BATCH = 2


def _contender(cp: int, mode: str, seq: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.config import ModelConfig
    from paratrain.memory import saved_activations

    config = ModelConfig(**MODEL, seq_len=seq)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (BATCH, seq + 1), generator=generator) for _ in range(4)]
    model = paratrain.build_gpt(config, seed=0)
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, cp=cp, cp_mode=mode,
                                                                       cp_ulysses=2 if mode == "usp" else 1))
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    shard = engine.parts.sequence
    first = (batches[0][:, :-1], batches[0][:, 1:])
    with saved_activations(engine.model) as saved:  # one forward on this rank's part of the sequences
        paratrain.lm_loss(engine.model, first if shard is None else shard.shard_batch(first))
    times, losses = [], []
    before = vm_bytes("VmSize")
    for i in range(steps + 1):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        losses.append(engine.train_step((batches[i % 4][:, :-1], batches[i % 4][:, 1:]), paratrain.lm_loss))
        if i >= 1:
            times.append(time.perf_counter() - started)
    return {"name": f"cp{cp}-{mode}" if cp > 1 else "cp1", "cp": cp, "mode": mode, "seq": seq,
            "step_s": statistics.median(times), "activations_mb": saved.bytes / 2**20,
            "step_peak_mb": (vm_bytes("VmPeak") - before) / 2**20, "live_mb": _live_tensor_mb(), "losses": losses}


def vm_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (VmSize: the address space now, VmPeak: its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ring", "ulysses", "usp"], choices=["ring", "ulysses", "usp"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # the ranks' address space follows their
    os.environ.setdefault("MALLOC_ARENA_MAX", "1")  # live tensors (read at spawn, by each fresh rank)
    results = []
    for seq in args.seq:
        for cp in args.cp:
            for mode in ([m for m in args.modes if m != "usp" or cp >= 4] if cp > 1 else ["ring"]):
                result = run_world(cp, _contender, cp, mode, seq, args.steps)
                results.append(result)
                print(f"seq {seq:>6}  {result['name']:<12} step {result['step_s']:7.3f} s   activations "
                      f"{result['activations_mb']:8.1f} MB   step peak {result['step_peak_mb']:8.1f} MB   live tensors "
                      f"{result['live_mb']:6.1f} MB   first loss {result['losses'][0]:.6f}", flush=True)
    print(f"\nGPT {MODEL}, {BATCH} samples, AdamW, gloo on CPU (dp = 1)")
    for seq in args.seq:
        base = next((r for r in results if r["seq"] == seq and r["cp"] == 1), None)
        for r in results:
            if base is not None and r["seq"] == seq and r["cp"] > 1:
                print(f"seq {seq} {r['name']} / cp1: step time x{r['step_s'] / base['step_s']:.2f}, activations "
                      f"x{r['activations_mb'] / base['activations_mb']:.3f} (1/cp = {1 / r['cp']:.3f}), step peak "
                      f"x{r['step_peak_mb'] / base['step_peak_mb']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
