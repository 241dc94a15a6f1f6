"""Building a model larger than one process: peak resident memory per process while building and
wrapping it, paratrain's meta-device build (each rank materialises only its pieces) against the whole
build every process made before (and torch FSDP2's meta-device recipe, as torchtitan does it).

    python -m bench.bench_materialize                                  # gpt3-xl, ZeRO-3, ~4 minutes
    python -m bench.bench_materialize --model gpt3-large --modes meta whole --whole-world 4

Each mode runs in fresh processes (spawned, gloo) so that ru_maxrss is its own. Reported per mode:
the world size, every rank's peak RSS in GiB and its growth over the process before building ("over
import"), the bytes of parameters + gradients + optimizer state the engine says it keeps per rank
(paratrain modes), and the build time (rank 0). The whole build holds the model in every process
whatever the world size: run it at a world that fits the machine (--whole-world; 4 processes of a
whole gpt3-xl need 4 x 5.3 GB before any sharding).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from bench.world import run_world


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def _job(mode: str, model_name: str, zero: int) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.config import preset

    config = preset(model_name)
    before = _current_rss_gib()
    start = time.perf_counter()
    state_gib = None
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from paratrain.models import GPT

        with torch.device("meta"):
            model = GPT(config)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():  # torchtitan's init_weights: random ops on the sharded DTensors
            for name, param in model.named_parameters():
                torch.nn.init.ones_(param) if name.endswith("norm.weight") else torch.nn.init.normal_(param, std=0.02)
            cos, sin = paratrain.models.gpt.rope_tables(config.seq_len, config.head_dim, config.rope_theta)
            model.rope_cos, model.rope_sin = cos, sin
    else:
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(zero=zero))
        model = paratrain.build_gpt(config, seed=0, device="meta" if mode == "meta" else "cpu")
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        state_gib = sum(engine.memory_report().values()) / 2**30
    seconds = time.perf_counter() - start
    mine = {"peak_gib": _rss_gib(), "over_import_gib": _rss_gib() - before, "state_gib": state_gib}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every, "build_s": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-xl")
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--world", type=int, default=4, help="processes for the meta build and FSDP2")
    parser.add_argument("--whole-world", type=int, default=2, help="processes for the whole build")
    parser.add_argument("--modes", nargs="+", default=["meta", "fsdp2", "whole"], choices=["meta", "fsdp2", "whole"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    from paratrain.config import preset

    config = preset(args.model)
    params = config.num_params()
    print(f"{args.model}: {params / 1e9:.2f}B parameters, {params * 4 / 2**30:.2f} GiB in float32; ZeRO-{args.zero}")
    results = {"model": args.model, "params": params, "zero": args.zero, "modes": {}}
    for mode in args.modes:
        world = args.whole_world if mode == "whole" else args.world
        out = run_world(world, _job, mode, args.model, args.zero)
        results["modes"][mode] = {"world": world, **out}
        peaks = ", ".join(f"{r['peak_gib']:.2f}" for r in out["ranks"])
        over = max(r["over_import_gib"] for r in out["ranks"])
        state = out["ranks"][0]["state_gib"]
        print(f"{mode:>6} on {world}: peak RSS per rank {peaks} GiB (at most {over:.2f} over import"
              + (f"; state {state:.2f} GiB per rank" if state is not None else "") + f"), built in {out['build_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
