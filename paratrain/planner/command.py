"""`paratrain plan`: the planner on the command line (a table, best layouts first, or one JSON object).

    paratrain plan --model gpt3-175b --gpus 1024 --hardware a100-80gb --global-batch 1536
    paratrain plan --model gpt3-xl --gpus 8 --hardware h100-80gb --global-batch 512 --tp 2 --json
    paratrain plan --model gpt2 --gpus 8 --global-batch 96 --ps-mode sync --ps-servers 2   # 6 trainers
    paratrain plan --model gpt3-175b --gpus 1024 --dp 16 --tp 8 --pp 8 --zero 1 --sequence-parallel \
        --global-batch 16 --dry-run --rank 1000       # rank 1000 built and stepped on shapes only
    paratrain plan --hf ./my-llama --gpus 8 --tp 2 --pp 2 --zero 1 --global-batch 64 --seq-len 2048
                                                  # a Hugging Face folder's model: each stage's first rank measured
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from paratrain.config.errors import ConfigError
from paratrain.config.model import PRESETS, preset
from paratrain.config.parallel import CP_MODES
from paratrain.config.run import FP8_RECIPES, PRECISIONS
from paratrain.planner.hardware import CPU_PROFILE, GPU_PROFILE, PROFILES, hardware
from paratrain.planner.diloco import check_groups, price_outer_step
from paratrain.planner.search import PRICED, search
from paratrain.planner.table import layout_text, plan_table

_PINS = {"--dp": "dp", "--tp": "tp", "--pp": "pp", "--virtual-stages": "virtual_stages", "--zero": "zero",
         "--micro-batch": "micro_batch", "--ep": "ep", "--cp": "cp", "--tp-depth": "tp_depth",
         "--cp-ulysses": "cp_ulysses"}
"""The layout's whole-number pins: flag -> Layout field."""

_MODE_PINS = {"--cp-mode": "cp_mode", "--tp-mode": "tp_mode"}
"""The layout's modes a flag pins (their choices are declared with the flags below): flag -> Layout field, which is
also ParallelConfig's."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2", help=f"model preset: {', '.join(PRESETS)}")
    parser.add_argument("--gpus", type=int, help="devices in all (or --nodes x --gpus-per-node)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, help="devices per node (default: the hardware's, 8)")
    parser.add_argument("--hardware", default="h100-80gb",
                        help=f"{', '.join(PROFILES)}, cpu or gpu (measured by --calibrate), or a JSON profile file")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's CPU profile (matmul rate, a GPT step's efficiency, gloo bandwidth "
                             "and latency; about 10 s), save it and print it; then --hardware cpu uses it. On a CUDA "
                             "machine: the GPU's GEMM table, memory bandwidth, attention rate and launch time (under a "
                             "minute) for --hardware gpu")
    parser.add_argument("--save-hardware", help=f"with --calibrate: save the profile here (default {CPU_PROFILE}, "
                        f"or {GPU_PROFILE} on CUDA)")
    parser.add_argument("--processes", type=int, default=2, help="with --calibrate: local processes for gloo (default 2)")
    parser.add_argument("--peak-tflops", type=float, help="override: dense 16-bit TFLOP/s per device")
    parser.add_argument("--memory-gb", type=float, help="override: memory per device, GB (1e9 bytes)")
    parser.add_argument("--intra-node-gbps", type=float, help="override: bus bandwidth inside a node, GB/s per device")
    parser.add_argument("--inter-node-gbps", type=float, help="override: bus bandwidth between nodes, GB/s per device")
    parser.add_argument("--efficiency", type=float, help="override: price every FLOP at this share of the peak (one "
                        "efficiency, no per-operation model)")
    parser.add_argument("--compile", action="store_true", help="price the blocks compiled (torch.compile: fewer "
                        "kernels and bytes; a per-operation profile only)")
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step (required unless --calibrate)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's)")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS,
                        help="fp8: the blocks' linears at the device's float8 rate, their casts, ZeRO-3's float8 "
                             "gathers (paratrain.planner.float8)")
    parser.add_argument("--fp8-recipe", default="tensorwise", choices=FP8_RECIPES)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                        help="price AdamW (two moments) or Muon (a momentum on the matrices, Newton-Schulz on owner "
                             "ranks and its all-to-alls: paratrain.planner.optimizer)")
    parser.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F", help="MoE under ep: a run's "
                        "expert_load_factor (--log-json); the busiest ep rank's rows, memory and time x F (default 1)")
    parser.add_argument("--tokens", type=float, help="a token budget: adds training days")
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--explain", action="store_true", help="also print the best layout's step time by term")
    parser.add_argument("--plot", metavar="OUT.png", help="also draw the busiest rank's memory of the top layouts and "
                        "the best one's pipeline schedule (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    for flag, field in _PINS.items():
        parser.add_argument(flag, type=int, help=f"pin {field}")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), help="pin recomputation")
    parser.add_argument("--cp-mode", choices=CP_MODES, help="pin context parallelism's attention (usp: with --cp-ulysses)")
    parser.add_argument("--tp-mode", choices=("1d", "2d", "2.5d", "3d"),
                        help="pin how tp splits each layer (the search tries 2d, 2.5d and 3d wherever tp is a square, "
                             "depth x a square or a cube, across nodes too; 1d within a node)")
    parser.add_argument("--ps-mode", choices=("sync", "async"),
                        help="price the parameter server: data parallelism over the trainers, the update on servers")
    parser.add_argument("--ps-servers", type=int, default=0,
                        help="with --ps-mode: dedicated servers among the --gpus devices (0: colocated)")
    parser.add_argument("--staleness", type=int, default=0, help="with --ps-mode async: clocks a trainer may run ahead")
    parser.add_argument("--dp-mode", choices=("sync", "diloco"), default="sync",
                        help="diloco: price DiLoCo's replica groups (each a job of --gpus / --replica-groups ranks on "
                             "its share of the global batch; the pins are a group's) and its outer step every "
                             "--inner-steps steps (paratrain.planner.diloco)")
    parser.add_argument("--replica-groups", type=int, default=1, help="with --dp-mode diloco: the groups")
    parser.add_argument("--inner-steps", type=int, default=1, help="with --dp-mode diloco: steps between outer steps")
    parser.add_argument("--sequence-parallel", action="store_true", default=None, help="pin sequence parallelism on")
    parser.add_argument("--dry-run", action="store_true",
                        help="build rank --rank of the pinned layout (--gpus ranks; --dp/--tp/--pp/--zero/--micro-batch) "
                             "on the meta device with a fake process group, run one step on shapes only, and report its "
                             "model-state bytes, collectives and pipeline actions against the planner's")
    parser.add_argument("--rank", type=int, default=0, help="with --dry-run: the rank to build (default 0)")
    parser.add_argument("--hf", metavar="DIR", help="a local Hugging Face folder's model in the pinned layout "
                        "(--gpus; --dp/--tp/--pp/--zero/--micro-batch): the first rank of each pipeline stage built "
                        "and stepped on the meta device, its model states and peak saved activations measured")
    parser.add_argument("--schedule", default="1f1b", help="with --dry-run: the pipeline schedule")
    parser.add_argument("--grad-reduce", default="reduce_scatter", choices=("reduce_scatter", "all_reduce"),
                        help="with --dry-run: ZeRO's gradient reduction (default NCCL's, reduce_scatter)")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if args.global_batch is None:
        raise ConfigError("paratrain plan needs --global-batch (samples per optimizer step)")
    model = preset(args.model)
    if args.hardware == "cpu":
        from paratrain.planner.calibrate import ensure_cpu_profile

        ensure_cpu_profile()
    hw = hardware(args.hardware, peak_flops=args.peak_tflops and args.peak_tflops * 1e12,
                  memory_bytes=args.memory_gb and args.memory_gb * 1e9,
                  intra_node_bw=args.intra_node_gbps and args.intra_node_gbps * 1e9,
                  inter_node_bw=args.inter_node_gbps and args.inter_node_gbps * 1e9, efficiency=args.efficiency)
    if args.gpus_per_node:
        from dataclasses import replace

        hw = replace(hw, devices_per_node=args.gpus_per_node)
    devices = args.gpus or args.nodes * hw.devices_per_node
    if devices < 1 or args.global_batch < 1:
        raise ConfigError(f"--gpus ({devices}) and --global-batch ({args.global_batch}) must be >= 1")
    if not (math.isfinite(args.moe_imbalance) and args.moe_imbalance >= 1):  # take it from a run's expert_load_factor
        raise ConfigError(f"--moe-imbalance is the busiest expert's load over the mean, at least 1 (balanced), got "
                          f"{args.moe_imbalance}: give a run's --log-json expert_load_factor")
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in {**_PINS, **_MODE_PINS}.items()}
    pins: dict[str, Any] = {field: value for field, value in given.items() if value is not None}
    if args.hf or args.dry_run:
        return _hf_plan(args, devices, pins) if args.hf else _dry_run(args, model, devices, pins)
    if args.recompute is not None:
        pins["recompute"] = args.recompute
    if args.sequence_parallel:
        pins["sequence_parallel"] = True
    if args.ps_mode is not None:
        pins.update(ps_mode=args.ps_mode, ps_servers=args.ps_servers, staleness=args.staleness)
    elif args.ps_servers or args.staleness:
        raise ConfigError(f"--ps-servers ({args.ps_servers}) and --staleness ({args.staleness}) price the parameter "
                          "server: give --ps-mode sync or async")
    if args.seq_len and args.seq_len > model.seq_len:  # the model is built for sequences this long
        model = dataclasses.replace(model, seq_len=args.seq_len)
    groups = args.replica_groups if args.dp_mode == "diloco" else 1
    if args.dp_mode == "diloco":
        check_groups(devices, args.global_batch, groups, args.inner_steps)
    elif args.replica_groups != 1 or args.inner_steps != 1:
        raise ConfigError("--replica-groups and --inner-steps price DiLoCo: give --dp-mode diloco")
    settings = dataclasses.replace(PRICED, precision=args.precision, optimizer=args.optimizer,
                                   moe_imbalance=args.moe_imbalance, fp8_recipe=args.fp8_recipe)
    result = search(model, devices // groups, hw, global_batch=args.global_batch // groups, seq_len=args.seq_len,
                    pins=pins, kernels="compiled" if args.compile else "eager", settings=settings)
    if groups > 1:
        price_outer_step(result["candidates"], model, hw, groups=groups, inner_steps=args.inner_steps,
                         settings=settings)
    if args.tokens:
        for record in result["candidates"]:
            record["train_days"] = args.tokens / record["tokens_per_s"] / 86400
    record = {"model": {"preset": args.model, **{k: getattr(model, k) for k in ("n_layer", "d_model", "n_head")},
                        "params": model.num_params()},
              "hardware": hw.to_dict(), "devices": devices, **result}
    if groups > 1:
        record["diloco"] = {"replica_groups": groups, "inner_steps": args.inner_steps}
    if args.plot:
        from paratrain.plot import plot_plan

        plot_plan(record, args.plot, global_batch=args.global_batch, top=min(args.top, 8))
    if args.json:
        print(json.dumps(record))
        return 0
    print(plan_table(record, args.top, tokens=args.tokens))
    if args.explain and record["candidates"]:
        best = record["candidates"][0]
        print(f"\n{layout_text(best['layout'])}: {best['step_time_s']:.4g} s per step, by term")
        for term, seconds in best["terms"].items():
            print(f"  {term:<36} {seconds:>10.4g} s  {seconds / best['step_time_s']:>6.1%}")
    if args.plot:
        print(f"drew {args.plot}")
    return 0


def _dry_run(args: argparse.Namespace, model: Any, devices: int, pins: dict[str, Any]) -> int:
    from paratrain.config.parallel import ParallelConfig
    from paratrain.planner.dryrun import dry_run, format_dry_run

    micro_batch = pins.pop("micro_batch", 1)
    parallel = ParallelConfig(**pins, sequence_parallel=bool(args.sequence_parallel), schedule=args.schedule,
                              grad_reduce=args.grad_reduce)
    if args.seq_len:
        from dataclasses import replace

        model = replace(model, seq_len=args.seq_len)
    run = dry_run(model, parallel, rank=args.rank, world_size=devices, global_batch=args.global_batch,
                  micro_batch=micro_batch, precision=args.precision, recompute=args.recompute or "none")
    print(json.dumps(run.to_dict()) if args.json else format_dry_run(run))
    return 0 if run.exact else 1


def _hf_plan(args: argparse.Namespace, devices: int, pins: dict[str, Any]) -> int:
    from paratrain.config.parallel import ParallelConfig
    from paratrain.hf.load import stand_in
    from paratrain.planner.hf import hf_memory

    micro_batch = pins.pop("micro_batch", 1)
    parallel = ParallelConfig(**pins, sequence_parallel=bool(args.sequence_parallel),
                              schedule=args.schedule).resolved(devices)
    shape = stand_in(args.hf, tp=parallel.tp_split, sequence_parallel=parallel.sequence_parallel)  # its family's tp rules
    ranks = hf_memory(args.hf, parallel, global_batch=args.global_batch, micro_batch=micro_batch,
                      seq_len=args.seq_len or shape.seq_len, precision=args.precision, recompute=args.recompute or "none")
    rows = [{"rank": r.rank, "stage": r.stage, **r.states, "activations": r.activations, "peak": r.peak,
             "seconds": round(r.seconds, 2)} for r in ranks]
    if args.json:
        print(json.dumps({"hf": args.hf, "devices": devices, "ranks": rows}))
        return 0
    gb = 1e9
    print(f"{args.hf} on {devices} ranks, dp{parallel.dp} tp{parallel.tp} pp{parallel.pp} z{parallel.zero} "
          f"mb{micro_batch}, measured on the meta device (GB):")
    print(f"{'rank':>6} {'stage':>5} {'peak':>8} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8}")
    for r in rows:
        print(f"{r['rank']:>6} {r['stage']:>5} {r['peak'] / gb:>8.2f} {r['params'] / gb:>8.2f} {r['grads'] / gb:>8.2f} "
              f"{r['optimizer'] / gb:>8.2f} {r['activations'] / gb:>8.2f}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from paratrain.planner.calibrate import calibrate

    import torch

    if torch.cuda.is_available():
        from paratrain.planner.calibrate_device import calibrate_device

        profile = calibrate_device(torch.device("cuda"))
        path = Path(args.save_hardware or GPU_PROFILE)
        best = max(max(row[1:]) for row in profile.gemm)
        summary = (f"{profile.name}, GEMMs up to {best:.0%} of {profile.peak_flops / 1e12:.0f} TFLOP/s, attention "
                   f"{profile.attention_efficiency:.0%}, memory {profile.memory_bw / 1e12:.2f} TB/s, "
                   f"{profile.launch_s * 1e6:.1f} us per eager launch; --hardware gpu uses it")
    else:
        if args.processes < 2:
            raise ConfigError(f"--processes must be >= 2 (gloo between local processes), got {args.processes}")
        profile = calibrate(args.processes)
        path = Path(args.save_hardware or CPU_PROFILE)
        summary = (f"{profile.peak_flops / 1e9:.1f} GFLOP/s float32 matmul per process, a GPT step reaches "
                   f"{profile.efficiency:.0%} of it plus {profile.overhead_s * 1e3:.2f} ms per block and micro-batch "
                   f"({profile.moe_overhead_s * 1e3:.2f} ms more per MoE layer); gloo "
                   f"{profile.intra_node_bw / 1e9:.2f} GB/s bus bandwidth, {profile.latency_s * 1e6:.0f} us latency; "
                   f"{profile.memory_bytes / 1e9:.1f} GB per process")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    print(json.dumps(profile.to_dict()) if args.json else f"saved {path}: {summary}")
    return 0
