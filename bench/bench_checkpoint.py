"""Checkpoints of a sharded model: paratrain's sharded format (every rank writes and reads its own
pieces) vs the whole-model gather it replaced (every rank gathers, rank 0 writes one file) vs torch
FSDP2 with torch.distributed.checkpoint (DCP), on the same GPT, ZeRO-3 / fully_shard over 4 processes.

    python -m bench.bench_checkpoint                       # small and gpt2, about 4 minutes on 2 cores
    python -m bench.bench_checkpoint --models small --modes sharded gathered

Each mode runs in fresh processes: build, one AdamW step (so that the optimizer state exists), save
(timed from a barrier to a barrier, the checkpoint on local disk; sharded-async: what the step waits for, the copy
into shared memory, and apart the writer processes' time to the publish), then a fresh model of the same
layout loads it (timed the same way). Reported for each: save and load seconds, the files written and
their bytes, and the growth of the peak resident memory of the worst rank during the save and during
the load (ru_maxrss after minus before: what the checkpoint itself cost on top of training).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from bench.world import run_world

MODES = ["sharded", "sharded-async", "gathered", "dcp-fsdp2"]


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _files(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _job(mode: str, model_name: str, root: str) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.config import preset

    config = preset(model_name, seq_len=64)
    batch = (torch.randint(0, 256, (1, 64)), torch.randint(0, 256, (1, 64)))

    def build():
        if mode == "dcp-fsdp2":
            from torch.distributed.fsdp import fully_shard

            model = paratrain.build_gpt(config, seed=0)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(zero=3))
        model = paratrain.build_gpt(config, seed=0, device="meta")
        return paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)), None

    def step(built):
        engine, optimizer = built
        if optimizer is None:
            engine.train_step(batch, paratrain.lm_loss)
        else:
            loss, count = paratrain.lm_loss(engine, batch)
            (loss / count).backward()
            optimizer.step()
            optimizer.zero_grad()

    def timed(fn):
        dist.barrier()
        before, start = _peak_gib(), time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start, _peak_gib() - before

    built = build()
    step(built)
    folder = Path(root) / "ckpt"

    written_s = None
    if mode.startswith("sharded"):
        from paratrain.checkpoint import load_sharded, resolve_checkpoint, save_sharded, verify_shared
        from paratrain.checkpoint.async_save import AsyncSaver

        if mode == "sharded":
            save = lambda: save_sharded(folder, 1, built[0].view(), {})  # noqa: E731
        else:  # what the step waits for; then, apart, the writer's time to the publish
            saver = AsyncSaver()
            save = lambda: saver.save(folder, 1, built[0].view(), {})  # noqa: E731
        fresh = build()
        # as the trainer resumes: verified with the SHA-256s shared out over the ranks, then read
        load = lambda: load_sharded(resolve_checkpoint(folder), verify_shared(resolve_checkpoint(folder)),  # noqa: E731
                                    fresh[0].view())
    elif mode == "gathered":
        from paratrain.checkpoint import load_checkpoint, save_checkpoint

        def save():
            state = built[0].state_dict()
            if dist.get_rank() == 0:
                save_checkpoint(folder, 1, state, {})

        fresh = build()

        def load():
            state, _ = load_checkpoint(folder)
            fresh[0].load_state_dict(state)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def save():
            model_state, optim_state = get_state_dict(built[0], built[1])
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))

        fresh = build()
        step(fresh)  # DCP loads into existing optimizer state

        def load():
            model_state, optim_state = get_state_dict(fresh[0], fresh[1])
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=str(folder))
            set_state_dict(fresh[0], fresh[1], model_state_dict=state["model"], optim_state_dict=state["optim"])
    save_s, save_gib = timed(save)
    again_s = None
    if mode == "sharded-async":  # the first save maps its staging buffer fresh; the next ones reuse it
        written_s = save_s + timed(saver.wait)[0]
        step(built)
        again_s = timed(lambda: saver.save(folder, 2, built[0].view(), {}))[0]
        timed(saver.close)
    load_s, load_gib = timed(load)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (save_gib, load_gib))
    files, size = _files(folder)
    return {"save_s": save_s, "written_s": written_s, "again_s": again_s, "load_s": load_s, "files": files, "bytes": size,
            "save_peak_growth_gib": max(e[0] for e in every), "load_peak_growth_gib": max(e[1] for e in every)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "gpt2"])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    for model in args.models:
        for mode in args.modes:
            root = tempfile.mkdtemp(prefix="bench-ckpt-")
            try:
                out = run_world(args.world, _job, mode, model, root)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            results.append({"model": model, "mode": mode, "world": args.world, **out})
            written = (f" (written and published {out['written_s']:.2f} s; the next save {out['again_s']:.2f} s)"
                       if out["written_s"] else "")
            print(f"{model:>6} {mode:>13}: save {out['save_s']:.2f} s{written} (+{out['save_peak_growth_gib']:.2f} GiB peak), "
                  f"load {out['load_s']:.2f} s (+{out['load_peak_growth_gib']:.2f} GiB peak), {out['files']} files, "
                  f"{out['bytes'] / 2**20:.0f} MiB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
