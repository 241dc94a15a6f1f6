"""What document masking costs: the GPT's step with packed documents masked against the same windows unmasked.

    python -m bench.bench_documents              # about 30 s on 2 cores
    python -m bench.bench_documents --seq 1024 --model small

One process, one thread, float32, AdamW: the same windows of a token stream cut into documents of random length
(mean --doc tokens), trained as (inputs, targets) with causal attention over the whole window, and as
(inputs, targets, positions) with each token attending inside its document (paratrain.nn.documents: a boolean
[B, 1, S, S] mask to torch's scaled_dot_product_attention). Reported: the median step time of each, their ratio,
and the bytes autograd keeps for backward (paratrain.memory.saved_activations), whose difference is the mask
sdpa keeps (B x S x S bytes per block).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.world import median_step_seconds


def run(model_name: str, seq: int, batch: int, doc: int, steps: int) -> dict:
    import paratrain
    from paratrain.config import preset
    from paratrain.data import GlobalBatchLoader
    from paratrain.memory import saved_activations

    torch.set_num_threads(1)
    config = preset(model_name, seq_len=seq)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * doc, size=4 * batch * seq // doc + 8)
    tokens = rng.integers(0, config.vocab_size, size=int(lengths.sum()))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    loader = GlobalBatchLoader(tokens, seq_len=seq, global_batch=batch, dp=1, dp_index=0, seed=0,
                               document_starts=starts)
    inputs, targets, positions = loader.gather(list(range(batch)))
    result = {"model": model_name, "seq": seq, "batch": batch, "mean_doc": doc}
    for name, data in (("causal", (inputs, targets)), ("documents", (inputs, targets, positions))):
        ctx = paratrain.init(device="cpu")
        model = paratrain.build_gpt(config, seed=0)
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        with saved_activations(engine.model) as saved:
            paratrain.lm_loss(engine.model, data)
        result[name] = {"step_s": median_step_seconds(engine, data, paratrain.lm_loss, steps), "saved_bytes": saved.bytes}
    result["ratio"] = result["documents"]["step_s"] / result["causal"]["step_s"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--doc", type=int, default=128, help="mean document length in tokens")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    r = run(args.model, args.seq, args.batch, args.doc, args.steps)
    print(f"{r['model']}, seq {r['seq']}, batch {r['batch']}, documents of {r['mean_doc']} tokens on average")
    print("| attention | step s | saved MB |")
    print("|---|---|---|")
    for name in ("causal", "documents"):
        print(f"| {name} | {r[name]['step_s']:.3f} | {r[name]['saved_bytes'] / 1e6:.1f} |")
    print(f"documents / causal: {r['ratio']:.2f}x step time")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
