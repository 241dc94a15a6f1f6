"""DiLoCo in `paratrain plan --dp-mode diloco --replica-groups R --inner-steps H`: each replica group is priced as a job
of its own (devices / R ranks, global batch / R: its layout is what the search ranks), and every candidate then gets
the outer step (paratrain.data_parallel.diloco):

    memory   + 2 x 4 bytes x E        the outer copy and the Nesterov buffer, float32, E = what the rank's optimizer
                                      steps (paratrain.planner.dp_comm.outer_elements: its parameters, or its ZeRO
                                      shard with padding), on its busiest pipeline stage
    time     + (latency + 2 (R - 1) / R x 4 E / bw) / H
                                      one all-reduce over the R groups every H steps, over the link the groups' ranks
                                      span (between nodes once the job outgrows one), not overlapped with compute

Tokens per second and MFU are the whole job's (R groups, each on its share of the global batch).
"""

from __future__ import annotations

from typing import Any

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.planner.dp_comm import outer_elements
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.settings import StepSettings

OUTER_BYTES = 4
"""The outer copy, its buffer and the all-reduced pseudo-gradient are float32 (what the optimizer steps)."""


def check_groups(devices: int, global_batch: int, groups: int, inner_steps: int) -> None:
    """The replica groups divide the devices and the global batch; H >= 1."""
    if groups < 2 or devices % groups or global_batch % groups:
        raise ConfigError(f"--replica-groups ({groups}) must be >= 2 and divide --gpus ({devices}) and --global-batch "
                          f"({global_batch}): each group is a job of gpus / groups ranks on its share of the batch")
    if inner_steps < 1:
        raise ConfigError(f"--inner-steps must be >= 1, got {inner_steps}")


def price_outer_step(candidates: list[dict[str, Any]], model: ModelConfig, hw: Hardware, *, groups: int,
                     inner_steps: int, settings: StepSettings) -> None:
    """Add DiLoCo's outer step to each candidate (one replica group's layout, as the search priced it), in place,
    and sort them again: fitting ones first, fastest first."""
    for record in candidates:
        layout = Layout.of(**{k: v for k, v in record["layout"].items()})
        elements = max(outer_elements(model, layout, stage=s, settings=settings) for s in range(layout.pp))
        held = 2 * OUTER_BYTES * elements
        memory = record["memory"]
        memory["diloco"] = held
        memory["peak"] += held
        memory["between_steps"] += held
        span = layout.dims.inside("dp") * layout.dp * groups  # the replica groups' ranks at one place lie this far apart
        bw = hw.intra_node_bw if span <= hw.devices_per_node else hw.inter_node_bw
        seconds = (hw.latency_s + 2 * (groups - 1) / groups * OUTER_BYTES * elements / bw) / inner_steps
        step = record["step_time_s"]
        record["terms"]["diloco outer step (per step)"] = seconds
        record["step_time_s"] = step + seconds
        record["comm_s"] += seconds
        record["tokens_per_s"] *= groups * step / (step + seconds)  # every group's tokens
        record["mfu"] *= step / (step + seconds)
        record["fits"] = memory["peak"] <= hw.memory_bytes
        record["diloco"] = {"replica_groups": groups, "inner_steps": inner_steps, "outer_elements": elements}
    candidates.sort(key=lambda r: (not r["fits"], r["step_time_s"]))
