"""Pipeline parallelism: paratrain's schedules vs torch.distributed.pipelining and DeepSpeed's
PipelineModule (when installed) on the same split.

    python -m bench.bench_pp                   # about 4 minutes on 2 cores
    python -m bench.bench_pp --steps 4 --only paratrain-1f1b torch-1f1b

pp = 2 on 2 processes (one core each, so a rank's time is its own), a GPT with 8 blocks (d_model 256,
4 heads, seq 128), 8 micro-batches of 2 samples per step, AdamW, fp32, cut at layer 5 (embedding +
4 blocks | 4 blocks + head). Reported for each contender: median step time and the peak bytes of
saved activations per stage over a step (paratrain.memory.ActivationMeter, the same meter for all);
for paratrain also the measured bubble, 1 - sum of compute time / (p x step time), next to the
formula (bench/bench_bubble.py's, for balanced stages) and to the replay: the simulator fed with every
action's measured time and free messages, which accounts for the stages' inequality and the compute's
jitter, so that measured - replayed is what communication and the executor add. --trace DIR writes
each paratrain schedule's last step as a Chrome trace (chrome://tracing, ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.world import run_world, without_missing

MODEL = {"vocab_size": 256, "seq_len": 128, "n_layer": 8, "n_head": 4, "d_model": 256}
MICRO, MICROBATCHES, PP = 2, 8, 2
SPLIT = (5,)
CONTENDERS = ["paratrain-gpipe", "paratrain-1f1b", "paratrain-interleaved", "paratrain-zero-bubble",
              "torch-gpipe", "torch-1f1b", "deepspeed-1f1b"]


def _contender(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.config import ModelConfig
    from paratrain.memory import ActivationMeter

    config = ModelConfig(**MODEL)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (MICRO * MICROBATCHES, config.seq_len + 1), generator=generator)
               for _ in range(3)]
    model = paratrain.build_gpt(config, seed=0)
    schedule = name.split("-", 1)[1]
    v = 2 if schedule == "interleaved" else 1
    split = (3, 5, 7) if v == 2 else SPLIT
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, pp=PP, schedule=schedule if name.startswith("paratrain")
                                                  else "1f1b", virtual_stages=v, pp_split=split))
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                   options=paratrain.EngineOptions(micro_batch=MICRO))
    stage = engine.model
    if name.startswith("paratrain"):
        def step(b):
            engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    elif name.startswith("deepspeed"):
        stage, step = _deepspeed(config)
    else:
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        class Chunk(nn.Module):  # paratrain's stage, seen by torch's pipelining as one module
            def __init__(self) -> None:
                super().__init__()
                self.stage = stage

            def forward(self, x):
                return stage.run_chunk(rank, x)

        tokens = MICRO * MICROBATCHES * config.seq_len

        def loss_fn(logits, targets):
            return stage.output.loss(logits, targets)[0] / tokens

        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        pipe = kind(PipelineStage(Chunk(), rank, PP, torch.device("cpu")), n_microbatches=MICROBATCHES,
                    loss_fn=loss_fn, scale_grads=False)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)

        def step(b):
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                pipe.step(b[:, :-1])
            else:
                pipe.step(target=b[:, 1:])
            optimizer.step()

    times, peaks, measured = [], [], []
    for i in range(steps + 2):
        dist.barrier()
        with ActivationMeter(stage) as meter:
            started = time.perf_counter()
            step(batches[i % 3])
            elapsed = time.perf_counter() - started
        if i >= 2:
            times.append(elapsed)
            peaks.append(meter.peak)
            if engine.pipeline is not None and name.startswith("paratrain"):
                measured.append(engine.pipeline.times)
    result = {"name": name, "step_s": statistics.median(times), "peak_mb": max(peaks) / 2**20}
    if measured:
        kinds: dict[str, list[float]] = {}
        for t in measured:
            for kind_name, seconds, count in t.by_kind:
                kinds.setdefault(kind_name, []).append(seconds / count)
        result.update(in_flight=measured[-1].peak_in_flight, timelines=measured,
                      kind_s={k: statistics.median(v) for k, v in kinds.items()})
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, result)
    return {"name": name, "ranks": parts}


def _deepspeed(config):
    """DeepSpeed's PipelineModule over the same layers (embedding | 8 blocks | norm + head), cut in
    the same place (uniform: 5 layers per stage), its 1F1B engine (train_batch). Its head is untied:
    a tied layer across stages is DeepSpeed's TiedLayerSpec, which this benchmark does not build."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from torch import nn

    import paratrain
    from dataclasses import replace

    model = paratrain.build_gpt(replace(config, tie_embeddings=False), seed=0)

    class Block(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block(x, model.rope_cos, model.rope_sin)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.head = model.norm, model.head

        def forward(self, x):
            return self.head(self.norm(x))

    def loss_fn(logits, targets):
        return model.output.loss(logits, targets)[0] / targets.numel()

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group the bench made
    layers = [model.tok_emb, *[Block(b) for b in model.blocks], Head()]
    pipe = PipelineModule(layers=layers, num_stages=PP, loss_fn=loss_fn, partition_method="uniform")
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICROBATCHES,
                 "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.AdamW(pipe.parameters(), lr=1e-4),
                                      config=ds_config, dist_init_required=False)

    def step(b):
        micro = [(b[i: i + MICRO, :-1], b[i: i + MICRO, 1:]) for i in range(0, b.shape[0], MICRO)]
        engine.train_batch(data_iter=iter(micro))

    return pipe, step


def _theory(schedule: str) -> float:
    from bench.bench_bubble import formula

    return formula(schedule, PP, MICROBATCHES)


def _bubbles(schedule: str, ranks: list[dict]) -> tuple[float, float]:
    """Median over steps of the measured bubble and of the replay's (every action's measured time,
    free messages: the stages' inequality and the compute's jitter, without communication)."""
    from paratrain.pipeline.timeline import measured_bubble, replay

    v = 2 if schedule == "interleaved" else 1
    steps = [[r["timelines"][s] for r in ranks] for s in range(len(ranks[0]["timelines"]))]
    return (statistics.median(measured_bubble(times) for times in steps),
            statistics.median(replay(times, schedule, microbatches=MICROBATCHES, chunks=v).bubble_fraction
                              for times in steps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--trace", help="write each paratrain schedule's last step as a Chrome trace into this folder")
    args = parser.parse_args(argv)
    args.only = without_missing(args.only)
    results = []
    for name in args.only:
        result = run_world(PP, _contender, name, args.steps)
        results.append(result)
        ranks = result["ranks"]
        step = max(r["step_s"] for r in ranks)
        line = f"{name:<24} step {step:6.3f} s   peak activations per stage " + \
            " / ".join(f"{r['peak_mb']:6.1f}" for r in ranks) + " MB"
        if "timelines" in ranks[0]:
            schedule = name.split("-", 1)[1]
            measured, replayed = _bubbles(schedule, ranks)
            result["bubble"] = {"measured": measured, "formula": _theory(schedule), "replayed": replayed}
            if args.trace:
                from paratrain.pipeline.timeline import chrome_trace

                Path(args.trace).mkdir(parents=True, exist_ok=True)
                trace = chrome_trace([r["timelines"][-1] for r in ranks])
                Path(args.trace, f"{name}.json").write_text(json.dumps(trace))
            line += (f"   bubble {measured:.3f} (formula {_theory(schedule):.3f}, replayed "
                     f"{replayed:.3f})   in flight " +
                     " / ".join(str(r["in_flight"]) for r in ranks) + "   ms per action " +
                     " / ".join(", ".join(f"{k} {v * 1000:.0f}" for k, v in r["kind_s"].items()) for r in ranks))
        print(line, flush=True)
    rows = {r["name"]: r for r in results}
    print(f"\nGPT {MODEL}, pp {PP}, {MICROBATCHES} micro-batches of {MICRO}, AdamW, gloo on CPU")
    for schedule, peer_name in (("gpipe", "torch-gpipe"), ("1f1b", "torch-1f1b"), ("1f1b", "deepspeed-1f1b")):
        ours, peer = rows.get(f"paratrain-{schedule}"), rows.get(peer_name)
        if ours and peer:
            a = max(r["step_s"] for r in ours["ranks"])
            b = max(r["step_s"] for r in peer["ranks"])
            print(f"paratrain / {peer_name}: step time x{a / b:.2f}, peak activations "
                  f"stage 0 x{ours['ranks'][0]['peak_mb'] / peer['ranks'][0]['peak_mb']:.2f}")
    if args.json:
        for result in results:
            for r in result["ranks"]:
                r.pop("timelines", None)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
