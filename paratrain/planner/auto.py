"""`paratrain train --plan auto`: the planner picks the layout for the processes at hand.

Before launch, on the launching process: the device's profile (a CUDA card by its name, the CPU by
its calibrated profile, `paratrain plan --calibrate`), the layouts of the world size that
paratrain's rules accept, ranked by predicted step time among those predicted to fit; the best one
becomes the run's dp, tp, pp, virtual stages, ZeRO stage, micro-batch, recomputation, sequence
parallelism, schedule, grid mode, shard groups, offload: every field of paratrain.config.layout. The chosen run is the run plan the launcher writes for its workers
(paratrain.config.plan.write_run), so every rank runs exactly the printed layout. Axes given on the
command line are pins the search keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paratrain.config.errors import ConfigError
from paratrain.config.layout import LAYOUT_SETTINGS, apply_layout
from paratrain.config.run import RunConfig
from paratrain.planner.hardware import Hardware, hardware
from paratrain.planner.search import PRICED, search

PINNABLE = tuple(setting.name for setting in LAYOUT_SETTINGS)
"""The layout fields a run's settings pin (paratrain.config.layout: every one the planner has)."""

_GPUS = [("H200", "h200"), ("H100", "h100-80gb"), ("A100", None)]


def device_hardware(device: str, *, processes: int, available_bytes: float | None) -> Hardware:
    """The profile of this node's device: a known GPU by its name, or the calibrated CPU profile with
    the memory available now shared by `processes` processes."""
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory
        for key, profile in _GPUS:
            if key in name:
                return hardware(profile or ("a100-80gb" if memory > 50e9 else "a100-40gb"))
        raise ConfigError(f"--plan auto has no profile for {name!r}: give the layout (--dp/--tp/--pp ...), "
                          "comparing candidates with `paratrain plan --hardware FILE.json`")
    from paratrain.planner.calibrate import ensure_cpu_profile

    ensure_cpu_profile()
    profile = hardware("cpu")
    if available_bytes is not None:
        profile = dataclasses.replace(profile, memory_bytes=available_bytes / processes)
    return profile


def choose_layout(config: RunConfig, *, world_size: int, hw: Hardware, pins: dict[str, Any],
                  seq_len: int) -> tuple[RunConfig, str]:
    """The run with the best predicted layout of `world_size` ranks filled in, and what to print."""
    from paratrain.config.model import preset

    model = preset(config.model.preset, **config.model.overrides)
    unknown = sorted(set(pins) - set(PINNABLE))
    if unknown:
        raise ConfigError(f"--plan auto cannot pin {unknown}: it chooses {sorted(PINNABLE)}")
    result = search(model, world_size, hw, global_batch=config.data.global_batch, seq_len=seq_len, pins=pins,
                    kernels="compiled" if config.train.compile else "eager",
                    settings=dataclasses.replace(PRICED, precision=config.train.precision, optimizer=config.optim.optimizer,
                                     grad_dtype=config.train.grad_dtype, state_dtype=config.optim.state_dtype,
                                     fp8_recipe=config.train.fp8_recipe))
    fitting = [r for r in result["candidates"] if r["fits"]]
    if not fitting:
        reason = (f"none of {len(result['candidates'])} layouts fits {hw.memory_bytes / 1e9:.1f} GB per process"
                  if result["candidates"] else f"no layout is made of these processes: {result['unmade']}"
                  if "unmade" in result else
                  f"paratrain's rules refuse all {len(result['rejected'])} layouts; the first: "
                  + (result["rejected"][0]["reason"] if result["rejected"] else "none"))
        raise ConfigError(f"--plan auto found no layout for {config.model.preset} on {world_size} processes "
                          f"(global batch {config.data.global_batch}{', pins ' + str(pins) if pins else ''}): "
                          f"{reason}; use more processes, a smaller --global-batch or model, or `paratrain plan`")
    best = fitting[0]
    layout = best["layout"]
    chosen = apply_layout(config, layout)  # every field the planner chose, where the run keeps it
    text = (f"--plan auto on {world_size} x {hw.name}: {describe(layout)}, predicted {best['step_time_s']:.3g} s "
            f"per step, peak {best['memory']['peak'] / 1e9:.2f} GB of {hw.memory_bytes / 1e9:.1f} GB "
            f"({len(fitting)} of {len(result['candidates'])} layouts fit)")
    if len(fitting) > 1:
        runner = fitting[1]
        text += (f"; runner-up {describe(runner['layout'])}: {runner['step_time_s'] / best['step_time_s']:.2f}x "
                 "the step time")
    return chosen, text


def describe(layout: dict[str, Any]) -> str:
    text = f"dp {layout['dp']} x tp {layout['tp']}"
    if layout.get("tp_mode", "1d") != "1d":
        text += f" ({layout['tp_mode']}" + (f", depth {layout['tp_depth']})" if layout["tp_mode"] == "2.5d" else ")")
    text += f" x pp {layout['pp']}"
    if layout["pp"] > 1:
        text += f" ({layout['schedule']}" + (f", {layout['virtual_stages']} chunks)" if layout["virtual_stages"] > 1 else ")")
    if layout.get("ep", 1) > 1:
        text += f", ep {layout['ep']}"
    if layout.get("expert_tp"):
        text += ", experts cut over tp"
    if layout.get("cp", 1) > 1:
        u = layout.get("cp_ulysses", 1)
        text += f", cp {layout['cp']} ({layout['cp_mode']}" + (
            f", Ulysses {u} x ring {layout['cp'] // u})" if layout["cp_mode"] == "usp" else ")")
    if layout.get("ps_mode", "off") != "off":
        text += f", parameter server ({layout['ps_mode']}, {layout['ps_servers']} dedicated servers" + (
            f", staleness {layout['staleness']})" if layout["ps_mode"] == "async" else ")")
    text += f", ZeRO {layout['zero']}"
    if layout.get("shard_group"):
        text += f" in shard groups of {layout['shard_group']}"
    if layout.get("offload"):
        text += ", optimizer offloaded"
    text += f", micro-batch {layout['micro_batch']}"
    if layout["recompute"] != "none":
        text += f", {layout['recompute']} recompute"
    if layout["sequence_parallel"]:
        text += ", sequence parallel"
    return text
