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
its collectives are broadcasts and reduces, counted as n bytes each: paratrain.comm.volume).

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
              "paratrain-tp4", "paratrain-tp4-sp", "paratrain-tp4-blocks", "dtensor-tp4", "paratrain-tp4-2d"]


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
        mode = "2d" if name.endswith("-2d") else "1d"
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, tp=world, sequence_parallel=sp,
                                                                           tp_mode=mode))
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                       tp_plan=BLOCKS_PLAN if name.endswith("-blocks") else None)

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
    return {"name": name, "world": world, "step_s": statistics.median(times),
            "activations_mb": saved.bytes / 2**20, "live_mb": _live_tensor_mb(),
            "comm_mb": counter.volume.total / 2**20, "collectives": len(counter.calls),
            "bsh_collectives": sum(1 for _, n in counter.calls if n == bsh),
            "megatron_mb": 4 * config.n_layer * 2 * bsh * 4 / 2**20}


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
              f"Megatron's blocks: {result['megatron_mb']:.1f} MB)", flush=True)
    rows = {r["name"]: r for r in results}
    print(f"\nGPT {MODEL}, {BATCH} samples, AdamW, gloo on CPU (dp = 1)")
    for tp in (2, 4):
        for ours in (f"paratrain-tp{tp}", f"paratrain-tp{tp}-blocks", f"paratrain-tp{tp}-sp"):
            peer = f"dtensor-tp{tp}"
            if ours in rows and peer in rows:
                print(f"{ours} / {peer}: step time x{rows[ours]['step_s'] / rows[peer]['step_s']:.2f}, "
                      f"activations x{rows[ours]['activations_mb'] / rows[peer]['activations_mb']:.2f}, "
                      f"live tensors x{rows[ours]['live_mb'] / rows[peer]['live_mb']:.2f}")
        grid = f"paratrain-tp{tp}-2d"
        for ours in (f"paratrain-tp{tp}", f"paratrain-tp{tp}-sp", f"dtensor-tp{tp}"):
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
