"""Packed documents under context parallelism: the attention work each cp rank does under the causal split
(ParallelConfig.cp_balance 'positions') and the document-aware split ('documents'), slowest rank over the mean.

    python -m bench.bench_cp_balance --json bench/results/cp-balance.json   # a second: integers, no processes
    python -m bench.bench_cp_balance --time --cp 2 --json bench/results/cpu-cp-balance-time.json   # ring attention

Work is counted as (query, key) pairs inside documents under the causal mask, what a kernel that skips masked
pairs does: the sum over a rank's tokens of their positions in their documents + 1. Those figures are exact
integers and do not depend on the machine. --time also runs ring attention (forward and backward, one row of
4,096 tokens, 8 heads of 64, float32) on cp fresh processes under each split, on the CPU's fused kernel with the
runs cut at the documents (paratrain.context_parallel.fused: only pairs inside documents computed), and reports
each rank's median time: the slowest rank's is the step's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from paratrain.context_parallel.layout import attention_pairs, document_split, local_positions

WINDOWS: dict[str, tuple[int, ...]] = {
    "long-first": (1800, 900, 500, 340, 250, 150, 100, 56),
    "long-last": (56, 100, 150, 250, 340, 500, 900, 1800),
    "geometric": (2048, 1024, 512, 256, 128, 64, 32, 32),
    "one-long": (3000, 400, 300, 200, 100, 50, 30, 16),
    "even": (512,) * 8,
}
"""8 documents of mixed lengths packed into one 4,096-token window (the issue's case), and an even window."""


def imbalance(lengths: tuple[int, ...], cp: int) -> dict:
    documents = torch.cat([torch.arange(n) for n in lengths])
    causal = torch.stack([local_positions(len(documents), r, cp) for r in range(cp)])
    row = {}
    for name, split in (("positions", causal), ("documents", document_split(documents, cp))):
        work = attention_pairs(documents, split)
        row[name] = {"pairs": work.tolist(), "slowest_over_mean": float(work.max() / work.double().mean())}
    return row


def _timed(lengths: tuple[int, ...], balance: str, repeats: int) -> list[float]:
    """Every cp rank's median seconds of one ring attention forward and backward over the packed window."""
    import statistics
    import time

    import torch.distributed as dist

    import paratrain
    from paratrain.context_parallel import AttentionSpec, ring_attention

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, cp=dist.get_world_size()))
    group = ctx.mesh.group("cp")
    documents = torch.cat([torch.arange(n) for n in lengths])
    everyone = (document_split(documents, group.size) if balance == "documents" else
                torch.stack([local_positions(len(documents), r, group.size) for r in range(group.size)]))
    mine = everyone[group.index]
    starts = tuple(torch.nonzero(documents == 0).flatten().tolist())
    gen = torch.Generator().manual_seed(group.index)
    q, k, v = (torch.randn(1, 8, len(mine), 64, generator=gen, requires_grad=True) for _ in range(3))
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        out = ring_attention(q, k, v, group, q_positions=mine, group_positions=everyone,
                             spec=AttentionSpec(documents=documents[mine].unsqueeze(0), document_starts=starts))
        out.sum().backward()
        if i:
            times.append(time.perf_counter() - started)
    gathered: list = [None] * group.size
    dist.all_gather_object(gathered, statistics.median(times))
    return gathered


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--windows", nargs="+", default=list(WINDOWS), choices=list(WINDOWS))
    parser.add_argument("--time", action="store_true", help="also time ring attention on cp processes per split")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = []
    print(f"{'window':<12} {'cp':>3}  slowest / mean attention pairs: positions   documents")
    for window in args.windows:
        for cp in args.cp:
            row = {"window": window, "lengths": WINDOWS[window], "cp": cp, **imbalance(WINDOWS[window], cp)}
            results.append(row)
            print(f"{window:<12} {cp:>3}  {row['positions']['slowest_over_mean']:>40.4f}   "
                  f"{row['documents']['slowest_over_mean']:.4f}", flush=True)
            if args.time:
                from bench.world import run_world

                for balance in ("positions", "documents"):
                    seconds = run_world(cp, _timed, WINDOWS[window], balance, args.repeats)
                    row[balance]["seconds"] = seconds
                    print(f"{'':<17}ring attention, {balance + ' split:':<17} each rank "
                          f"{', '.join(f'{t * 1e3:.1f}' for t in seconds)} ms (slowest {max(seconds) * 1e3:.1f} ms)",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
