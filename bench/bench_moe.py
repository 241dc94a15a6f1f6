"""Mixture-of-Experts: the MoE GPT on one process, dp 2 (experts replicated), ep 2 and ep 4, tp 2 with the
experts replicated, cut over tp (expert-tp), under sequence parallelism and both, ep 2 compiled; and one MoE
layer, paratrain's against DeepSpeed's (deepspeed.moe.layer.MoE) at the same shapes, when installed; and the
routers of 2025-2026 on one process against the softmax top-2 one (ROUTERS).

    python -m bench.bench_moe                          # about 6 minutes on 2 cores
    python -m bench.bench_moe --steps 4 --only paratrain-ep2 deepspeed-layer-ep2
    python -m bench.bench_moe --steps 8 --only paratrain-1proc router-sigmoid router-top4 router-deepseek router-fine

DeepSpeed is optional; to include it: DS_BUILD_OPS=0 pip install -c constraints.txt --no-build-isolation
deepspeed==0.19.8.

Model contenders train the same MoE GPT (4 blocks, d_model 256, 8 experts of width 512 in every
block, top-2, dropless, seq 128, global batch 8, AdamW) from the same weights, each in fresh
processes. Reported for rank 0: median step time, the share of it spent in the all-to-alls (timed
around paratrain.comm.all_to_all, counts exchange included), the bytes of parameters + gradients +
optimizer state the rank holds in a step, the bytes of its experts' weights, and the all-to-all bytes of
one step (CollectiveCounter).

Layer contenders run forward + backward of one MoE layer on 1024 tokens of width 256 per rank, 8
experts (two-layer MLPs of width 512), top-2, no capacity limit, over ep ranks: paratrain's MoE
with AllToAllExperts, and DeepSpeed's MoE (drop_tokens=False, its gating normalising the top-2).
The sequence-parallel pair runs one sequence of 1024 tokens split over tp 2 (experts replicated):
routed where the chunks are (paratrain's choice) against gathered first and routed whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.world import run_world, without_missing

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=8, d_model=256, n_experts=8, top_k=2, d_expert=512)
GLOBAL_BATCH = 8
TOKENS, WIDTH, EXPERTS, HIDDEN = 1024, 256, 8, 512
LAYOUTS = {  # model contender -> (processes, ParallelConfig fields, parallelize's compile)
    "paratrain-1proc": (1, {}, False), "paratrain-dp2": (2, {}, False), "paratrain-ep2": (2, {"ep": 2}, False),
    "paratrain-ep4": (4, {"ep": 4}, False),
    "paratrain-tp2": (2, {"tp": 2}, False),  # experts replicated over tp: each rank runs them whole
    "paratrain-tp2-etp": (2, {"tp": 2, "expert_tp": True}, False),  # each expert cut over tp
    "paratrain-tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, False),  # each rank routes its chunk
    "paratrain-tp2-sp-etp": (2, {"tp": 2, "sequence_parallel": True, "expert_tp": True}, False),
    "paratrain-ep2-compiled": (2, {"ep": 2}, True),  # blocks compiled by inductor, the MoE layers eager
}
ROUTERS = {  # one process, the model's router changed (paratrain.nn.router): what each choice costs a step
    "router-sigmoid": dict(router="sigmoid"),  # top-2 of sigmoid scores, renormalised
    "router-top4": dict(top_k=4),  # softmax top-4: twice the expert work of top-2
    "router-deepseek": dict(router="sigmoid", top_k=4, expert_groups=4, topk_groups=2, router_scale=2.5,
                            expert_bias_rate=1e-3),  # DeepSeek-V3's choice: groups, bias, scale
    "router-fine": dict(n_experts=16, d_expert=256, router="sigmoid", top_k=4, expert_groups=4, topk_groups=2,
                        router_scale=2.5, expert_bias_rate=1e-3),  # fine-grained: 2x the experts at half the width
    "router-fine-mtp1": dict(n_experts=16, d_expert=256, router="sigmoid", top_k=4, expert_groups=4, topk_groups=2,
                             router_scale=2.5, expert_bias_rate=1e-3, mtp_depth=1),  # and one MTP depth (DeepSeek-V3)
}
for _router in ROUTERS:
    LAYOUTS[_router] = (1, {}, False)
CONTENDERS = [*LAYOUTS, "paratrain-layer-ep2", "deepspeed-layer-ep2", "paratrain-layer-sp-local2",
              "paratrain-layer-sp-gather2"]


def _timed_all_to_all() -> list[float]:
    """Wrap the all-to-all expert parallelism calls with a clock; returns the list the seconds go to."""
    from paratrain.expert_parallel import layout

    spent: list[float] = []
    inner = layout.all_to_all

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        inner(*args, **kwargs)
        spent.append(time.perf_counter() - began)

    layout.all_to_all = timed
    return spent


def _model(name: str, steps: int) -> dict:
    import torch

    import paratrain
    from paratrain.comm import CollectiveCounter
    from paratrain.config import ModelConfig
    from paratrain.data import GlobalBatchLoader, load_source
    from paratrain.models import lm_loss

    _, fields, compile = LAYOUTS[name]
    spent = _timed_all_to_all()
    ctx = paratrain.init(paratrain.ParallelConfig(**fields), device="cpu")
    model = paratrain.build_gpt(ModelConfig(**{**MODEL, **ROUTERS.get(name, {})}), seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                                   options=paratrain.EngineOptions(compile=compile))
    experts = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters() if ".experts." in n)
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=MODEL["seq_len"], global_batch=GLOBAL_BATCH,
                               dp=ctx.mesh.degree("dp"), dp_index=ctx.mesh.index("dp"), seed=0)
    times, shares = [], []
    for step in range(steps + 2):  # step 0 warms up (compiles), step 1 counts the collectives
        batch = loader.next()
        spent.clear()
        if step == 1:
            with CollectiveCounter() as counter:
                engine.train_step(batch, lm_loss)
            continue
        began = time.perf_counter()
        engine.train_step(batch, lm_loss)
        elapsed = time.perf_counter() - began
        if step:
            times.append(elapsed)
            shares.append(sum(spent) / elapsed)
    memory = engine.memory_report()
    return {"step_s": statistics.median(times), "all_to_all_share": statistics.median(shares),
            "state_mb": memory["in_step"] / 2**20, "experts_mb": experts / 2**20,
            "all_to_all_mb": counter.volume.bytes.get("all_to_all", 0) / 2**20, "world": ctx.world_size}


def _layer(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    if name.startswith("deepspeed"):
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        deepspeed.init_distributed(dist_backend="gloo")
        expert = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))
        layer = DeepSpeedMoE(WIDTH, expert, num_experts=EXPERTS, ep_size=dist.get_world_size(), k=2,
                             drop_tokens=False)
        layer.set_deepspeed_parallelism()
        run = lambda: layer(x)[0]  # noqa: E731  (output, aux loss, counts)
    elif "-sp-" in name:  # sequence parallelism at tp 2: a sequence of TOKENS split over the ranks
        run = _sequence_parallel_layer(name, x)
    else:
        from paratrain.expert_parallel import apply_expert_parallel
        from paratrain.nn.moe import MoE
        from paratrain.topology import init

        ctx = init(__import__("paratrain").ParallelConfig(ep=dist.get_world_size()), device="cpu")
        layer = MoE(WIDTH, n_experts=EXPERTS, top_k=2, d_ff=HIDDEN, capacity_factor=0.0, aux_coef=0.01, z_coef=0.001)
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.02)
        apply_expert_parallel(layer, ctx.mesh.group("ep"))  # this rank's experts, AllToAllExperts
        run = lambda: layer(x)  # noqa: E731
    spent = _timed_all_to_all()
    times, shares = [], []
    for step in range(steps + 1):
        spent.clear()
        began = time.perf_counter()
        run().float().pow(2).mean().backward()
        elapsed = time.perf_counter() - began
        if step:
            times.append(elapsed)
            shares.append(sum(spent) / elapsed)
    return {"step_s": statistics.median(times), "all_to_all_share": statistics.median(shares) if spent else None,
            "world": dist.get_world_size()}


def _sequence_parallel_layer(name: str, x):  # type: ignore[no-untyped-def]
    """One MoE layer (experts replicated over tp 2) on a sequence split over the tp ranks, two ways: "local",
    each rank routes its chunk (what paratrain does); "gather", the sequence all-gathered first and every rank
    routing all of it, as plain tensor parallelism would (backward keeps the rank's slice), then its chunk
    of the output kept."""
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.comm.regions import _region, _split, all_gather_along
    from paratrain.nn.moe import MoE
    from paratrain.tensor_parallel.sequence import SequenceChunks

    ctx = paratrain.init(paratrain.ParallelConfig(tp=dist.get_world_size()), device="cpu")
    group = ctx.mesh.group("tp")
    torch.manual_seed(0)
    layer = MoE(WIDTH, n_experts=EXPERTS, top_k=2, d_ff=HIDDEN, capacity_factor=0.0, aux_coef=0.01, z_coef=0.001)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    chunk = x[:, : TOKENS // group.size].detach().requires_grad_()
    if "local" in name:
        layer.split_sequence(SequenceChunks(group))
        return lambda: layer(chunk)
    n = chunk.shape[1]
    return lambda: layer(_region(chunk, group, 1, all_gather_along, _split))[:, group.index * n:(group.index + 1) * n]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", choices=CONTENDERS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    contenders = without_missing(args.only or CONTENDERS)
    results = {}
    for name in contenders:
        world = LAYOUTS[name][0] if name in LAYOUTS else int(name[-1])
        fn = _layer if "layer" in name else _model
        results[name] = run_world(world, fn, name, args.steps)
        print(f"{name:>22}: {json.dumps(results[name])}", flush=True)
    base = results.get("paratrain-1proc")
    for name in ROUTERS:
        if base and name in results:
            print(f"{name} step time / softmax top-2: {results[name]['step_s'] / base['step_s']:.2f}")
    if base:
        for name in LAYOUTS:
            if name in results and name != "paratrain-1proc" and name not in ROUTERS:
                print(f"{name} step time / one process: {results[name]['step_s'] / base['step_s']:.2f}")
    if "paratrain-layer-sp-local2" in results and "paratrain-layer-sp-gather2" in results:
        ratio = results["paratrain-layer-sp-gather2"]["step_s"] / results["paratrain-layer-sp-local2"]["step_s"]
        print(f"MoE layer under sequence parallelism (tp 2), gathered / routed locally step time: {ratio:.2f}")
    if "paratrain-layer-ep2" in results and "deepspeed-layer-ep2" in results:
        ratio = results["deepspeed-layer-ep2"]["step_s"] / results["paratrain-layer-ep2"]["step_s"]
        print(f"MoE layer at ep 2, DeepSpeed / paratrain step time: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
