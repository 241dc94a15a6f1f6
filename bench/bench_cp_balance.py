"""Packed documents under context parallelism: the attention work each cp rank does under the causal split
(ParallelConfig.cp_balance 'positions') and the document-aware split ('documents'), slowest rank over the mean.

    python -m bench.bench_cp_balance --json bench/results/cp-balance.json   # a second: integers, no processes

Work is counted as (query, key) pairs inside documents under the causal mask, what a kernel that skips masked
pairs does (a varlen flash kernel): the sum over a rank's tokens of their positions in their documents + 1. The
figures are exact integers and do not depend on the machine. paratrain's own kernels (the CPU flash kernel
and the plain block kernel of paratrain.context_parallel.ring) compute each ring block's causal rectangle, not
its documents, so on them the document-aware split's time gain is not measured.
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--windows", nargs="+", default=list(WINDOWS), choices=list(WINDOWS))
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = []
    print(f"{'window':<12} {'cp':>3}  slowest / mean attention pairs: positions   documents")
    for window in args.windows:
        for cp in args.cp:
            row = {"window": window, "lengths": WINDOWS[window], "cp": cp, **imbalance(WINDOWS[window], cp)}
            results.append(row)
            print(f"{window:<12} {cp:>3}  {row['positions']['slowest_over_mean']:>40.4f}   "
                  f"{row['documents']['slowest_over_mean']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
