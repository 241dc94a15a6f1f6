"""Muon against AdamW under ZeRO: paratrain's Muon (each matrix orthogonalised once, by an owner rank: one
all-to-all each way) and AdamW at ZeRO-1 and ZeRO-3, torch.optim.Muon under DDP (every rank orthogonalises every
matrix, the plain way), and DeepSpeed's Muon (ZeRO-1/2; when installed), step time on 1, 2 and 4 processes.

    python -m bench.bench_optim                       # about 5 minutes on 2 cores
    python -m bench.bench_optim --worlds 2 --steps 4 --only paratrain-muon-zero1 paratrain-adamw-zero1

Every contender trains the same GPT (6 layers, d_model 384, 10.7M parameters, 8.8M of them in 24 matrices, seq 128,
8 samples per rank) from the same weights in fresh processes; Newton-Schulz in bfloat16 (torch's default), 5
steps. Reported for rank 0: the median step time (forward, backward, reduction, update) and Muon / AdamW.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.world import barrier_step_seconds, contest_arguments, run_world

MODEL = dict(vocab_size=256, seq_len=128, n_layer=6, n_head=6, d_model=384)
PER_RANK = 8
CONTENDERS = ["paratrain-adamw-zero1", "paratrain-muon-zero1", "paratrain-muon-zero1-4mb", "paratrain-adamw-zero3",
              "paratrain-muon-zero3", "ddp-torch-muon", "deepspeed-muon-zero1", "deepspeed-muon-zero2"]
BUCKET_MB = {"paratrain-muon-zero1-4mb": 4.0}
"""The exchange's bucket (ParallelConfig.bucket_mb, the gradients' too): the default 25 MiB holds the 8.8M matrix
elements in one bucket (bfloat16: 17.6 MB); 4 MiB cuts them into several, each owner holding its share of each,
every bucket's all-to-alls overlapping another's Newton-Schulz."""


def _contender(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import paratrain
    from paratrain.config import ModelConfig
    from paratrain.optim import EXCLUDE, MuonFactory, MuonSettings, is_matrix

    config = ModelConfig(**MODEL)
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (PER_RANK, config.seq_len + 1), generator=generator) for _ in range(4)]
    model = paratrain.build_gpt(config, seed=0)
    muon = MuonSettings(lr=1e-3, adjust_lr_fn="match_rms_adamw")

    def mean_loss(m, b):
        return F.cross_entropy(m(b[:, :-1]).reshape(-1, 256), b[:, 1:].reshape(-1))

    if name.startswith("paratrain"):
        zero = int(name.split("zero")[1][0])
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=world, zero=zero,
                                                                          bucket_mb=BUCKET_MB.get(name, 25.0)))
        factory = MuonFactory(muon) if "muon" in name else (lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        engine = paratrain.parallelize(model, ctx, optimizer=factory)

        def step(b):
            engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    elif name.startswith("deepspeed"):
        import deepspeed

        ds_config = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": int(name[-1])}, "steps_per_print": 10**9,
                     "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "momentum": 0.95}}}
        for n, p in model.named_parameters():  # DeepSpeed's Muon reads this flag: the same split as ours
            p.use_muon = is_matrix(n, tuple(p.shape), EXCLUDE)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                          dist_init_required=False)

        def step(b):
            loss = mean_loss(engine, b)
            engine.backward(loss)
            engine.step()
    else:  # DDP, and torch.optim.Muon + AdamW on every rank
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        matrices = [p for n, p in model.named_parameters() if is_matrix(n, tuple(p.shape), EXCLUDE)]
        rest = [p for n, p in model.named_parameters() if not is_matrix(n, tuple(p.shape), EXCLUDE)]
        optimizers = [torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                      torch.optim.AdamW(rest, lr=1e-3)]

        def step(b):
            mean_loss(wrapped, b).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    return {"name": name, "world": world, "step_s": barrier_step_seconds(step, batches, steps)}


def main(argv: list[str] | None = None) -> None:
    args = contest_arguments(__doc__.split("\n")[0], CONTENDERS, worlds=[1, 2, 4], steps=5, argv=argv)
    results = []
    for world in args.worlds:
        for name in args.only:
            try:
                result = run_world(world, _contender, name, args.steps)
            except Exception as error:  # a peer that does not run here is said, not fatal
                print(f"{world} procs  {name:<22} did not run: {str(error).splitlines()[-1][:200]}", flush=True)
                continue
            results.append(result)
            print(f"{world} procs  {name:<25} step {result['step_s']:6.3f} s", flush=True)
    print(f"\nGPT {MODEL}, {PER_RANK} samples x {MODEL['seq_len']} tokens per rank, gloo on CPU")
    for world in args.worlds:
        rows = {r["name"]: r for r in results if r["world"] == world}
        for ours, peer in (("paratrain-muon-zero1", "paratrain-adamw-zero1"),
                           ("paratrain-muon-zero1-4mb", "paratrain-muon-zero1"),
                           ("paratrain-muon-zero3", "paratrain-adamw-zero3"),
                           ("paratrain-muon-zero1", "ddp-torch-muon"), ("paratrain-muon-zero1", "deepspeed-muon-zero1")):
            if ours in rows and peer in rows:
                print(f"{world} procs  {ours} / {peer}: step time x{rows[ours]['step_s'] / rows[peer]['step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
