"""Tensor parallelism: paratrain tp {1, 2, 4} (with and without sequence parallelism) vs torch's
DTensor tensor parallel (parallelize_module, ColwiseParallel / RowwiseParallel) on the same GPT.

    python -m bench.bench_tp                     # about 5 minutes on 2 cores
    python -m bench.bench_tp --steps 4 --only paratrain-tp2 dtensor-tp2

Every contender trains the same GPT (4 layers, d_model 512, 8 heads, seq 128, 8 samples, AdamW)
from the same weights, in fresh processes (dp = 1: every rank sees the whole batch). Reported for
rank 0: median step time; "activations", the bytes autograd saves for backward in one forward
(paratrain.memory.saved_activations, parameters left out); "live tensors", every tensor storage
alive after the timed steps (a gc scan: parameters, gradients, optimizer state); and the
collectives of one training step, counted at torch's dispatcher for every contender alike
(paratrain.comm.CollectiveCounter), against the Megatron formula: per block 2 all-reduces of
b x s x h in forward and 2 in backward.

"-2d" is the same GPT_PLAN on a 2 x 2 grid (tp_mode 2d: SUMMA, every weight and activation in q x q blocks;
its collectives are broadcasts and reduces, counted as n bytes each: paratrain.comm.volume); at 8 ranks "-2.5d"
stacks two such grids (tp_depth 2) and "-3d" is a 2 x 2 x 2 cube, against 1d tp 8 (8 processes on 2 cores: the
step times are oversubscribed, the bytes and memory are not).

Two paratrain plans: "tp" is GPT_PLAN (blocks, and the vocabulary of the tied embedding / head with
a vocab-parallel loss), "blocks" splits only the blocks, exactly what the DTensor plan splits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.bench_zero import _live_tensor_mb
from bench.world import run_world

MODEL = {"vocab_size": 256, "seq_len": 128, "n_layer": 4, "n_head": 8, "d_model": 512}
BATCH = 8
BLOCKS_PLAN = {"attn.qkv": "column", "attn.out": "row", "mlp.up": "column", "mlp.down": "row"}
CONTENDERS = ["paratrain-tp1", "paratrain-tp2", "paratrain-tp2-sp", "paratrain-tp2-blocks", "dtensor-tp2",
              "paratrain-tp4", "paratrain-tp4-sp", "paratrain-tp4-blocks", "dtensor-tp4", "paratrain-tp4-2d",
              "paratrain-tp8", "paratrain-tp8-sp", "dtensor-tp8", "paratrain-tp8-2.5d", "paratrain-tp8-3d"]


def _contender(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.comm import CollectiveCounter
    from paratrain.config import ModelConfig
    from paratrain.memory import saved_activations

    config = ModelConfig(**MODEL)
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (BATCH, config.seq_len + 1), generator=generator) for _ in range(4)]
    model = paratrain.build_gpt(config, seed=0)
    if name.startswith("paratrain"):
        sp = name.endswith("-sp")
        mode = next((m for m in ("2d", "2.5d", "3d") if name.endswith(f"-{m}")), "1d")
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, tp=world, sequence_parallel=sp,
                                                                           tp_mode=mode,
                                                                           tp_depth=2 if mode == "2.5d" else 1))
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                       recipe=paratrain.recipe_for(
                                           model, tp_plan=BLOCKS_PLAN if name.endswith("-blocks") else None))

        def step(b):
            engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.out": RowwiseParallel(),
                                         "blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(b):
            loss_sum, count = paratrain.lm_loss(model, (b[:, :-1], b[:, 1:]))
            (loss_sum / count).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with saved_activations(model) as saved:
        paratrain.lm_loss(model, (batches[0][:, :-1], batches[0][:, 1:]))
    times = []
    counter = CollectiveCounter()
    for i in range(steps + 2):
        dist.barrier()
        started = time.perf_counter()
        if i == 1:
            with counter:
                step(batches[i % 4])
        else:
            step(batches[i % 4])
        if i >= 2:
            times.append(time.perf_counter() - started)
    bsh = BATCH * config.seq_len * config.d_model
    mode = next((m for m in ("2d", "2.5d", "3d") if name.endswith(f"-{m}")), "1d")
    return {"name": name, "linears_formula_mb": grid_linears_bytes(config, mode, world, BATCH * config.seq_len) / 2**20, "world": world, "step_s": statistics.median(times),
            "activations_mb": saved.bytes / 2**20, "live_mb": _live_tensor_mb(),
            "comm_mb": counter.volume.total / 2**20, "collectives": len(counter.calls),
            "bsh_collectives": sum(1 for _, n in counter.calls if n == bsh),
            "megatron_mb": 4 * config.n_layer * 2 * bsh * 4 / 2**20}


def grid_linears_bytes(config, mode: str, tp: int, tokens: int) -> float:  # type: ignore[no-untyped-def]
    """The documented bytes (float32) every linear of a step moves per rank, forward and backward, under a grid mode
    (paratrain.tensor_parallel.summa and .cube): 2d 2 T out / q + 3 |W| / q; 2.5d the same on each grid's T / d
    tokens, + 2 |W| / q^2 over depth; 3d 3 T in / q^2 + 2 T out / q^2 + 3 |W| / q^2. 0 under 1d."""
    d, f, v = config.d_model, config.ff_dim, config.padded_vocab
    shapes = [(3 * d, d), (d, d), (f, d), (d, f)] * config.n_layer + [(v, d)]  # (out, in) of qkv, out, up, down, head
    total = 0.0
    for out, inp in shapes:
        w = out * inp
        if mode in ("2d", "2.5d"):
            depth = 2 if mode == "2.5d" else 1
            q = round((tp // depth) ** 0.5)
            total += 2 * tokens / depth * out / q + 3 * w / q + (2 * w / q**2 if depth > 1 else 0)
        elif mode == "3d":
            q = round(tp ** (1 / 3))
            total += (3 * tokens * inp + 2 * tokens * out + 3 * w) / q**2
    return 4 * total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = []
    for name in args.only:
        world = int(name.split("-tp")[1][0])
        result = run_world(world, _contender, name, args.steps)
        results.append(result)
        print(f"{name:<22} step {result['step_s']:6.3f} s   activations {result['activations_mb']:6.1f} MB   "
              f"live tensors {result['live_mb']:6.1f} MB   comm {result['comm_mb']:6.1f} MB in "
              f"{result['collectives']:3d} collectives ({result['bsh_collectives']} of b x s x h; "
              f"Megatron's blocks: {result['megatron_mb']:.1f} MB"
              + (f"; grid linears' formula {result['linears_formula_mb']:.1f} MB" if result["linears_formula_mb"] else "")
              + ")", flush=True)
    rows = {r["name"]: r for r in results}
    print(f"\nGPT {MODEL}, {BATCH} samples, AdamW, gloo on CPU (dp = 1)")
    for tp in (2, 4, 8):
        for ours in (f"paratrain-tp{tp}", f"paratrain-tp{tp}-blocks", f"paratrain-tp{tp}-sp"):
            peer = f"dtensor-tp{tp}"
            if ours in rows and peer in rows:
                print(f"{ours} / {peer}: step time x{rows[ours]['step_s'] / rows[peer]['step_s']:.2f}, "
                      f"activations x{rows[ours]['activations_mb'] / rows[peer]['activations_mb']:.2f}, "
                      f"live tensors x{rows[ours]['live_mb'] / rows[peer]['live_mb']:.2f}")
        for grid, ours in ((f"paratrain-tp{tp}-{m}", o) for m in ("2d", "2.5d", "3d")
                           for o in (f"paratrain-tp{tp}", f"paratrain-tp{tp}-sp", f"dtensor-tp{tp}")):
            if grid in rows and ours in rows:
                print(f"{grid} / {ours}: step time x{rows[grid]['step_s'] / rows[ours]['step_s']:.2f}, "
                      f"bytes moved x{rows[grid]['comm_mb'] / rows[ours]['comm_mb']:.2f}, "
                      f"activations x{rows[grid]['activations_mb'] / rows[ours]['activations_mb']:.2f}, "
                      f"live tensors x{rows[grid]['live_mb'] / rows[ours]['live_mb']:.2f}")
        if "paratrain-tp1" in rows and f"paratrain-tp{tp}-sp" in rows:
            ratio = rows[f"paratrain-tp{tp}-sp"]["activations_mb"] / rows["paratrain-tp1"]["activations_mb"]
            print(f"paratrain-tp{tp}-sp activations / tp1: {ratio:.3f} (1/tp = {1 / tp:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
