"""The parameter server against collective data parallelism, and its asynchronous mode against a straggler.

    python -m bench.bench_ps                      # about 5 minutes on 2 cores
    python -m bench.bench_ps --world 2 --steps 2 --only ps-colocated dp --scenarios

Part 1, the same world of processes and the same global batch (GPT 4 layers, d_model 256, 3.2M parameters,
seq 128, 16 samples per step; AdamW): paratrain's all-reduce data parallelism (GradSync), ZeRO-2, torch's DDP,
and the synchronous parameter server colocated on every process (a reduce-scatter and an all-gather in
point-to-point messages) and with half the processes as dedicated servers (half the trainers, each with twice
the samples). Per contender: median step time of rank 0 (a trainer), and the bytes a trainer sends per step:
measured for the parameter server (its pushes), the ring algorithm's 2 psi (n - 1) / n for the collectives
(CollectiveCounter's volume, which counts an all-reduce of n bytes as 2n, times (n - 1) / n); a dedicated
server receives T psi / S.

Part 2, 2 trainers and 1 server, stragglers: "alternating", each trainer stalls 2 x its step time once every
4 steps, trainer 0 at the second step of each 4 and trainer 1 at the fourth (a synchronous step waits for
whichever is stalled: 2 stalls per 4 steps; asynchronously each trainer pays only its own); "slow", trainer
1 stalls 1 x its step time every step (always half as fast). Per mode (sync, async with staleness 0, 2 and
8): steps per second of the job (until both trainers finish) and of trainer 0, and the largest staleness
seen. Bounded staleness absorbs stalls that come and go; against a trainer that is always slower the other
can only run s + 1 clocks ahead, so the job goes at the slow one's rate whatever s (the SSP rule).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.world import run_world

MODEL = dict(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
GLOBAL_BATCH = 16
CONTENDERS = ["dp", "zero2", "ddp", "ps-colocated", "ps-dedicated"]
SCENARIOS = {"alternating": (2.0, 4, {0: 1, 1: 3}), "slow": (1.0, 1, {1: 0})}
"""Stragglers: (a stall in units of a trainer's own step time, every how many steps, {trainer: the step
of each period it stalls at})."""


def _batches(rank_index: int, trainers: int, count: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(rank_index)
    rows = GLOBAL_BATCH // trainers
    return [torch.randint(0, 256, (rows, MODEL["seq_len"] + 1), generator=generator) for _ in range(count)]


def _contender(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import paratrain
    from paratrain.comm.volume import CollectiveCounter
    from paratrain.config import ModelConfig
    from paratrain.param_server import ServerClient

    world = dist.get_world_size()
    servers = world // 2 if name == "ps-dedicated" else 0
    trainers = world - servers
    model = paratrain.build_gpt(ModelConfig(**MODEL), seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        optimizer = adamw(wrapped.parameters())

        def step(b):
            F.cross_entropy(wrapped(b[:, :-1]).reshape(-1, 256), b[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        config = (paratrain.ParallelConfig(ps_mode="sync", ps_servers=servers) if name.startswith("ps")
                  else paratrain.ParallelConfig(dp=world, zero=2 if name == "zero2" else 0))
        ctx = paratrain.init(device="cpu", config=config)
        if ctx.is_server:
            return {"server": paratrain.serve(model, ctx, optimizer=adamw).memory}
        engine = paratrain.parallelize(model, ctx, optimizer=adamw)

        def step(b):
            engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    rank = dist.get_rank()
    batches = _batches(rank, trainers, 4)
    times = []
    for i in range(steps + 2):
        started = time.perf_counter()
        if i == 1:
            with CollectiveCounter() as counter:
                step(batches[i % 4])
        else:
            step(batches[i % 4])
        if i >= 2:
            times.append(time.perf_counter() - started)
    psi = sum(p.numel() * 4 for p in model.parameters())
    if name.startswith("ps"):
        client = engine.grads  # the parameter server's client is the engine's gradient strategy
        assert isinstance(client, ServerClient)
        # colocated, this rank is also a server: the pushes it received and the replies it sent
        local = client.local
        sent = client.pushed_bytes + (local.sent_bytes if local is not None else 0)
        received = client.pulled_bytes + (local.received_bytes if local is not None else 0)
        sent, received = sent / (steps + 2), received / (steps + 2)
        memory = engine.memory_report()
        engine.close()
    else:
        # CollectiveCounter counts an all-reduce of n bytes as 2n, a reduce-scatter's input or an all-gather's
        # output as n: a ring sends (and receives) (k - 1) / k of that
        sent = received = counter.volume.total * (world - 1) / world
        memory = engine.memory_report() if name != "ddp" else None
    return {"name": name, "world": world, "trainers": trainers, "servers": servers, "step_s": statistics.median(times),
            "sent_mb": sent / 2**20, "received_mb": received / 2**20, "psi_mb": psi / 2**20,
            "state_mb": sum(memory.values()) / 2**20 if memory else None}


def _server_traffic(world: int, steps: int) -> dict:
    """ps-dedicated once more, for a server's view: its bytes received and sent per step, its memory."""
    from tests.pool import RankPool

    pool = RankPool(world, collective_timeout_s=300.0)
    try:
        got = pool.run(_server_side, steps, timeout=1800.0)
    finally:
        pool.close()
    return got[-1]


def _server_side(steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import paratrain
    from paratrain.config import ModelConfig

    world = dist.get_world_size()
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(ps_mode="sync", ps_servers=world // 2))
    model = paratrain.build_gpt(ModelConfig(**MODEL), seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if ctx.is_server:
        from paratrain.param_server import build_server
        from paratrain.param_server.loops import serve_loop

        server = build_server(model, ctx, adamw)
        serve_loop(server)
        return {"received_mb": server.received_bytes / steps / 2**20, "sent_mb": server.sent_bytes / steps / 2**20,
                "state_mb": (server.memory()["params"] + server.memory()["optimizer"]) / 2**20,
                "exchange_mb": server.memory()["exchange"] / 2**20}
    engine = paratrain.parallelize(model, ctx, optimizer=adamw)
    for b in _batches(ctx.rank, world - world // 2, steps):
        engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    engine.close()
    return {}


def _straggler(mode: str, staleness: int, scenario: str, steps: int) -> dict:
    import torch

    import paratrain
    from paratrain.config import ModelConfig

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(
        ps_mode=mode, ps_servers=1, staleness=staleness if mode == "async" else 0))
    model = paratrain.build_gpt(ModelConfig(**MODEL), seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if ctx.is_server:
        paratrain.serve(model, ctx, optimizer=adamw)
        return {"server": True}
    engine = paratrain.parallelize(model, ctx, optimizer=adamw)
    batches = _batches(ctx.rank, 2, 4)
    for b in batches[:2]:  # warm up; measure a step's time, the straggler's unit
        began = time.perf_counter()
        engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
    unit = time.perf_counter() - began
    units, every, phases = SCENARIOS[scenario]  # a straggler sleeps in units of its own step time
    done, stale = [], []
    started = time.perf_counter()
    for i in range(steps):
        if ctx.rank in phases and i % every == phases[ctx.rank]:
            time.sleep(units * unit)
        b = batches[i % 4]
        engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss)
        done.append(time.perf_counter() - started)
        assert engine.last is not None
        stale.append(engine.last.staleness["staleness"] if engine.last.staleness else 0)
    engine.close()
    return {"trainer": ctx.rank, "finished_s": done[-1], "unit_s": unit, "staleness_max": max(stale)}


def _straggler_world(mode: str, staleness: int, scenario: str, steps: int) -> dict:
    from tests.pool import RankPool

    pool = RankPool(3, collective_timeout_s=300.0)
    try:
        got = pool.run(_straggler, mode, staleness, scenario, steps, timeout=1800.0)
    finally:
        pool.close()
    trainers = got[:2]
    return {"scenario": scenario, "mode": mode, "staleness": staleness,
            "job_steps_per_s": steps / max(t["finished_s"] for t in trainers),
            "trainer0_steps_per_s": steps / trainers[0]["finished_s"],
            "staleness_max": max(t["staleness_max"] for t in trainers), "unit_s": trainers[0]["unit_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS),
                        help="straggler scenarios of part 2 (none: skip it)")
    parser.add_argument("--straggler-steps", type=int, default=24)
    parser.add_argument("--stalenesses", type=int, nargs="*", default=[0, 2, 8],
                        help="the asynchronous mode's stalenesses of part 2 (none: the synchronous mode alone)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    same_world: list[dict] = []
    straggler: list[dict] = []
    results: dict[str, object] = {"same_world": same_world, "straggler": straggler}
    for name in args.only:
        row = run_world(args.world, _contender, name, args.steps)
        same_world.append(row)
        state = f"{row['state_mb']:6.1f}" if row["state_mb"] is not None else "     -"
        print(f"{args.world} procs ({row['trainers']} trainers)  {name:<13} step {row['step_s']:6.3f} s   a trainer "
              f"sends {row['sent_mb']:6.2f} MB, receives {row['received_mb']:6.2f} MB a step (psi {row['psi_mb']:.2f} "
              f"MB)   state {state} MB", flush=True)
    if "ps-dedicated" in args.only:
        results["server"] = _server_traffic(args.world, args.steps + 2)
        server = results["server"]
        print(f"{args.world} procs  ps-dedicated: a server receives {server['received_mb']:6.2f} MB and sends "
              f"{server['sent_mb']:6.2f} MB a step; holds {server['state_mb']:.1f} MB (slices and AdamW), "
              f"{server['exchange_mb']:.1f} MB of pushes at once", flush=True)
    rows = {r["name"]: r for r in same_world}
    for ours in ("ps-colocated", "ps-dedicated", "zero2", "ddp"):
        if ours in rows and "dp" in rows:
            print(f"{ours} / dp: step time x{rows[ours]['step_s'] / rows['dp']['step_s']:.2f}, bytes a trainer sends "
                  f"x{rows[ours]['sent_mb'] / rows['dp']['sent_mb']:.2f}")
    for scenario in args.scenarios:
        for mode, staleness in [("sync", 0)] + [("async", s) for s in args.stalenesses]:
            row = _straggler_world(mode, staleness, scenario, args.straggler_steps)
            straggler.append(row)
            print(f"{scenario:<11} {mode:<5} s={staleness}  job {row['job_steps_per_s']:5.2f} steps/s, trainer 0 "
                  f"{row['trainer0_steps_per_s']:5.2f} steps/s, staleness max {row['staleness_max']:.0f}", flush=True)
    print(f"\nGPT {MODEL}, {GLOBAL_BATCH} samples per step, AdamW, gloo on CPU")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
