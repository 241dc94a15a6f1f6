"""Sharded data parallelism: paratrain ZeRO-0/1/2/3 vs torch FSDP2, ZeroRedundancyOptimizer and
DeepSpeed ZeRO-1/2/3 (when installed), step time and per-rank peak memory, on 2 and 4 processes.

    python -m bench.bench_zero                          # about 10 minutes on 2 cores
    python -m bench.bench_zero --worlds 2 --steps 4 --only paratrain-zero3 fsdp2

DeepSpeed is optional (not a dependency of paratrain); to include it:
    DS_BUILD_OPS=0 pip install -c constraints.txt --no-build-isolation deepspeed==0.19.8

Every contender trains the same GPT (6 layers, d_model 384, 10.7M parameters, seq 128, 8 samples
per rank, AdamW) from the same weights, each in a fresh set of processes, so that the peak
resident memory (ru_maxrss) belongs to it alone. Reported for rank 0: median step time; "live
tensors", the bytes of all tensor storages alive after the timed steps, found by a gc scan that
counts each storage once (parameters, gradients, optimizer state, flat buffers, whatever each
contender keeps between steps: the same measure for all); "peak RSS", the peak resident memory
above what the process held before building the model, which on CPU is dominated by the allocator
keeping freed memory (and so says little about sharding); for paratrain also the exact bytes of
its model states it reports between steps ("state": parameters and optimizer state, the gradient
buffers being released after each update) and in a step ("in step": with the gradient buffers).
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

from bench.world import barrier_step_seconds, contest_arguments, run_world

MODEL = dict(vocab_size=256, seq_len=128, n_layer=6, n_head=6, d_model=384)
PER_RANK = 8
CONTENDERS = ["paratrain-zero0", "paratrain-zero1", "paratrain-zero2", "paratrain-zero3", "ddp",
              "zero_redundancy", "fsdp2", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _live_tensor_mb() -> float:
    """Bytes of every tensor storage alive in this process (paratrain.memory.live_tensor_bytes), in MiB."""
    from paratrain.memory import live_tensor_bytes

    return live_tensor_bytes() / 2**20


def _contender(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import paratrain
    from paratrain.config import ModelConfig

    config = ModelConfig(**MODEL)
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (PER_RANK, config.seq_len + 1), generator=generator) for _ in range(4)]
    before = _rss_mb()
    state_mb = None
    model = paratrain.build_gpt(config, seed=0)

    def mean_loss(m, b):
        return F.cross_entropy(m(b[:, :-1]).reshape(-1, 256), b[:, 1:].reshape(-1))

    if name.startswith("paratrain"):
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=world, zero=int(name[-1])))
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))

        def step(b):
            engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    elif name.startswith("deepspeed"):
        import deepspeed

        ds_config = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": int(name[-1])}, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          config=ds_config, dist_init_required=False)

        def step(b):
            loss = mean_loss(engine, b)
            engine.backward(loss)
            engine.step()
    else:
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model)
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        elif name == "zero_redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel as DDP

            wrapped = DDP(model)
            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        elif name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            wrapped = fully_shard(model)
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        else:
            raise ValueError(name)

        def step(b):
            mean_loss(wrapped, b).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    live_before = _live_tensor_mb()  # model and batches, before any optimizer state or gradient
    step_s = barrier_step_seconds(step, batches, steps)
    in_step_mb = None
    if name.startswith("paratrain"):
        report = engine.memory_report()
        state_mb, in_step_mb = report["between_steps"] / 2**20, report["in_step"] / 2**20
    return {"name": name, "world": world, "step_s": step_s,
            "peak_mb": _rss_mb() - before, "state_mb": state_mb, "in_step_mb": in_step_mb,
            "live_mb": _live_tensor_mb(), "live_before_mb": live_before}


def main(argv: list[str] | None = None) -> None:
    args = contest_arguments(__doc__.split("\n")[0], CONTENDERS, worlds=[2, 4], steps=6, argv=argv)
    results = []
    for world in args.worlds:
        for name in args.only:
            result = run_world(world, _contender, name, args.steps)
            results.append(result)
            state = (f"{result['state_mb']:8.1f} MB (in step {result['in_step_mb']:.1f})"
                     if result["state_mb"] is not None else "       -")
            print(f"{world} procs  {name:<17} step {result['step_s']:6.3f} s   live tensors {result['live_mb']:7.1f} MB"
                  f"   peak RSS {result['peak_mb']:7.1f} MB   state {state}", flush=True)
    print(f"\nGPT {MODEL}, {PER_RANK} samples x {MODEL['seq_len']} tokens per rank, AdamW, gloo on CPU")
    for world in args.worlds:
        rows = {r["name"]: r for r in results if r["world"] == world}
        for ours, peer in (("paratrain-zero0", "ddp"), ("paratrain-zero1", "zero_redundancy"),
                           ("paratrain-zero3", "fsdp2"), ("paratrain-zero1", "deepspeed-zero1"),
                           ("paratrain-zero2", "deepspeed-zero2"), ("paratrain-zero3", "deepspeed-zero3")):
            if ours in rows and peer in rows:
                print(f"{world} procs  {ours} / {peer}: step time x{rows[ours]['step_s'] / rows[peer]['step_s']:.2f}, "
                      f"live tensors x{rows[ours]['live_mb'] / rows[peer]['live_mb']:.2f}, "
                      f"peak RSS x{rows[ours]['peak_mb'] / max(rows[peer]['peak_mb'], 1e-9):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
