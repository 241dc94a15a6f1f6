"""The pipeline bubble of every schedule, measured on the real executor, against its formula.

    python -m bench.bench_bubble                 # about 2 minutes
    python -m bench.bench_bubble --pp 2 --schedules 1f1b --steps 3

The stages are an nn.Sequential of 8 layers of known cost: a layer's forward, input gradient and
weight gradient each take `--unit` milliseconds (sleeping, so that neither compute jitter nor
processes sharing a core blur what is measured; the executor, its point-to-point messages over gloo
and the autograd engine between actions are real). Stages are balanced, so the formulas apply:

    GPipe, 1F1B      (p - 1) / (m + p - 1) of the step
    interleaved      (p - 1) / (v m) of the ideal time, so (p - 1) / (v m + p - 1) of the step
    zero-bubble      (p - 1)(F + I) / (m (F + I + W) + (p - 1)(F + I)) of the step: paratrain's list-scheduled
                     zero bubble keeps 1F1B's per-stage memory bound, which leaves (p - 1)(F + I) idle per
                     rank instead of 1F1B's (p - 1)(F + I + W)
    zb-h1            (p - 1)(F + I - W) / (m (F + I + W) + (p - 1)(F + I - W)) of the step: Qi et al.'s ZB-H1,
                     every rank holding p micro-batches at most
    zb-v             two chunks a rank in a V, list-scheduled with equal passes (chunk 0's I empty, its W the
                     whole backward, as the executor runs it), 2p chunks (p stages' activations) a rank at most:
                     Schedule.bubble, its simulated span (1 / 25 of the step at p = 2, 3 / 51 at p = 4, m = 8)
    dualpipev        the V in DualPipeV's eight phases (a whole B beside I and W): Schedule.bubble, its simulated
                     span (p - 1 passes idle a rank: 1 / 49 of the step at p = 2, 3 / 51 at p = 4, m = 8)

Measured bubble of a step: 1 - sum of compute time / (p x the longest rank's step time); the median
over steps is reported with its ratio to the formula and the replay (the simulator fed with every
action's measured duration and free messages: what the schedule gives on exactly these costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.world import run_world

LAYERS, WIDTH, ROWS_PER_MICRO, MICROBATCHES = 8, 16, 2, 8
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero-bubble", "zb-h1", "zb-v", "dualpipev"]


def _contender(schedule: str, pp: int, unit: float, steps: int) -> dict:
    import torch
    from torch import nn

    import paratrain
    import torch.distributed as dist
    from paratrain.pipeline.timeline import measured_bubble, replay

    class Held(torch.autograd.Function):
        """Identity whose forward and backward take fixed times."""

        @staticmethod
        def forward(ctx, x, forward_s: float, backward_s: float):
            time.sleep(forward_s)
            ctx.backward_s = backward_s
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.backward_s)
            return grad, None, None

    class Timed(nn.Module):
        """out = x + bias: the path to x takes `unit` forward and backward (I), the one to the bias
        `unit` backward (W), so zero bubble's I and W each cost one unit. The first layer's input
        needs no gradient; its bias takes both units, so every stage's backward costs the same."""

        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(WIDTH))

        def forward(self, x):
            if x.requires_grad:
                return Held.apply(x, unit, unit) + Held.apply(self.bias, 0.0, unit)
            return Held.apply(x, unit, 0.0) + Held.apply(self.bias, 0.0, 2 * unit)

    v = 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, pp=pp, schedule=schedule, virtual_stages=v))
    model = nn.Sequential(*[Timed() for _ in range(LAYERS)])

    def squared_error(output, target):
        return ((output - target) ** 2).sum(), target.numel()

    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=ROWS_PER_MICRO),
                                   recipe=paratrain.recipe_for(model, pipeline_loss=squared_error))
    x = torch.randn(ROWS_PER_MICRO * MICROBATCHES, WIDTH)
    latency = _latency(ctx.mesh.group("pp"), torch.zeros(ROWS_PER_MICRO, WIDTH))
    measured = []
    for i in range(steps + 2):
        dist.barrier()
        engine.train_step((x, x), lambda m, b: squared_error(m(b[0]), b[1]))
        if i >= 2:
            measured.append(engine.pipeline.times)
    everyone: list = [None] * pp
    dist.all_gather_object(everyone, measured)
    per_step = [[everyone[r][s] for r in range(pp)] for s in range(steps)]
    bubbles = [measured_bubble(times) for times in per_step]
    replays = [replay(times, schedule, microbatches=MICROBATCHES, chunks=v).bubble_fraction for times in per_step]
    with_latency = [replay(times, schedule, microbatches=MICROBATCHES, chunks=v, latency=latency).bubble_fraction
                    for times in per_step]
    per_kind: list[dict[str, list[float]]] = [{} for _ in range(pp)]
    for times in per_step:
        for rank, t in enumerate(times):
            for kind, _, _, start, end in t.events:
                per_kind[rank].setdefault(kind, []).append(end - start)
    ms_per_action = [{kind: round(1000 * statistics.mean(spans), 2) for kind, spans in sorted(kinds.items())}
                     for kinds in per_kind]
    return {"schedule": schedule, "pp": pp, "measured": statistics.median(bubbles),
            "replayed": statistics.median(replays), "replayed_with_latency": statistics.median(with_latency),
            "latency_ms": latency * 1000, "ms_per_action": ms_per_action,
            "step_s": statistics.median(max(t.total for t in times) for times in per_step)}


def _latency(group, message) -> float:
    """Half the median round trip of one activation-sized message between pipeline ranks 0 and 1 (the
    others wait): the time a message adds to a path through it, host work on both sides included."""
    import torch.distributed as dist

    trips = []
    for _ in range(30):
        dist.barrier(group=group.pg)
        started = time.perf_counter()
        if group.index == 0:
            dist.send(message, group.ranks[1], group=group.pg)
            dist.recv(message, group.ranks[1], group=group.pg)
        elif group.index == 1:
            dist.recv(message, group.ranks[0], group=group.pg)
            dist.send(message, group.ranks[0], group=group.pg)
        trips.append(time.perf_counter() - started)
    return statistics.median(trips) / 2


def formula(schedule: str, p: int, m: int) -> float:
    """Bubble fraction of the step for balanced stages with F = I = W (B = I + W)."""
    f, i, w = 1.0, 1.0, 1.0
    if schedule == "interleaved":
        return (p - 1) / (2 * m + p - 1)
    if schedule == "zero-bubble":
        return (p - 1) * (f + i) / (m * (f + i + w) + (p - 1) * (f + i))
    if schedule == "zb-h1":
        return (p - 1) * (f + i - w) / (m * (f + i + w) + (p - 1) * (f + i - w))
    if schedule in ("zb-v", "dualpipev"):  # their simulated spans, equal passes and chunk 0's I empty
        from paratrain.pipeline.schedules import Schedule

        return Schedule(schedule, p, 2).bubble(m)
    return (p - 1) / (m + p - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--unit", type=float, default=20.0, help="milliseconds per layer per F, I and W")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    print(f"{LAYERS} layers of {args.unit:g} ms per F / I / W, {MICROBATCHES} micro-batches, gloo on CPU")
    print(f"{'pp':>3} {'schedule':<12} {'step':>8} {'measured':>9} {'formula':>8} {'ratio':>6} {'replayed':>9} "
          f"{'+latency':>9} {'latency':>8}")
    results = []
    for pp in args.pp:
        for schedule in args.schedules:
            r = run_world(pp, _contender, schedule, pp, args.unit / 1000, args.steps)
            r["formula"] = formula(schedule, pp, MICROBATCHES)
            results.append(r)
            print(f"{pp:>3} {schedule:<12} {r['step_s']:7.3f}s {r['measured']:9.4f} {r['formula']:8.4f} "
                  f"{r['measured'] / r['formula']:6.3f} {r['replayed']:9.4f} {r['replayed_with_latency']:9.4f} "
                  f"{r['latency_ms']:6.2f}ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
