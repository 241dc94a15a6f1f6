"""The parameter server in the planner: what a trainer and a server hold, the bytes a step moves, its time.

T trainers (dp), S dedicated servers (ps_servers; colocated: S = T, trainer i serving slice i). The buckets
are paratrain.param_server.layout's: the trainable parameters in size-capped buckets of one optimizer group
each (plan_buckets, as ZeRO plans them), each padded to a multiple of S; psi is their padded total.

    trainer     float32 parameters and gradients, every bucket whole (4 psi each); the optimizer state is
                the servers' (dedicated: none here), or its own slices' (colocated: AdamW's two moments over
                psi / S and a step per bucket)
    server      its slices (4 psi / S), AdamW's moments over them and a step per bucket; while a synchronous
                clock is received, every trainer's push of its slices (T x 4 psi / S: the sum accumulates
                into the first);
                asynchronously, the sums of the clocks not yet applied and the push arriving (at most
                s + 2 pushes: a bound, the run's own figure is ShardServer.memory()["exchange"])
    traffic     per step a trainer pushes its gradients' slices and pulls the parameters: 4 psi bytes each
                way (colocated: (S - 1) / S of it, a reduce-scatter and an all-gather in point-to-point
                messages: ZeRO-2's bytes); a server receives and sends T x 4 psi / S
    time        after backward, not overlapped with it: the push, the servers' update, the pull. Each phase
                takes its busiest link: a trainer's 4 psi, or a server's T x 4 psi / S (the server is the
                bottleneck once T > S). The update's arithmetic is not counted (nor is any layout's).

`model_state_bytes` (paratrain.planner.memory) gives the trainer's figures for a layout with ps_mode set;
tests/distributed/test_planner.py checks them, the server's and the traffic against a run to the byte.
Sparse tables (ps_sparse) are not priced: the planner's GPT trains with AdamW, which they refuse.
"""

from __future__ import annotations

import functools
import math

import torch

from paratrain.comm.buckets import plan_buckets
from paratrain.config.model import ModelConfig
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.params import meta_tensors, rank_params
from paratrain.planner.memory import STEP_BYTES, optimizer_group, with_totals
from paratrain.topology.dims import ParallelDims

ELEMENT = 4
"""The parameter server keeps parameters and gradients in float32 (the model as built; autocast computes)."""


@functools.lru_cache(maxsize=1024)
def buckets(model: ModelConfig, servers: int, bucket_bytes: int) -> tuple[int, ...]:
    """Each bucket's padded elements (a multiple of `servers`), in served_groups' order."""
    params = rank_params(model, ParallelDims(), 0)
    present = sorted({optimizer_group(p) for p in params})
    tensors = meta_tensors(params, torch.float32)
    group_of = {id(t): present.index(optimizer_group(p)) for t, p in zip(tensors, params)}
    planned = plan_buckets(tensors, cap_bytes=bucket_bytes, key=lambda t: group_of[id(t)])
    return tuple(math.ceil(sum(t.numel() for t in group) / servers) * servers for group in planned)


def slice_count(layout: Layout) -> int:
    """S: the servers the buckets are cut over (the trainers themselves when colocated)."""
    return layout.ps_servers or layout.dp


def trainer_state_bytes(model: ModelConfig, layout: Layout, *, bucket_mb: float = 25.0,
                        keep_grads: bool = False) -> dict[str, int]:
    """What a trainer's engine.memory_report() says: {"params", "grads", "optimizer", "in_step", "between_steps"}
    (the dense gradients released between steps, unless keep_grads)."""
    sizes = buckets(model, slice_count(layout), int(bucket_mb * 2**20))
    psi = sum(sizes)
    optimizer = 0
    if not layout.ps_servers:  # colocated: its own slice of every bucket, AdamW's two moments and a step
        optimizer = 2 * ELEMENT * psi // layout.dp + STEP_BYTES * len(sizes)
    return with_totals({"params": ELEMENT * psi, "grads": ELEMENT * psi, "optimizer": optimizer},
                       kept_grads=ELEMENT * psi if keep_grads else 0)


def server_state_bytes(model: ModelConfig, layout: Layout, *, bucket_mb: float = 25.0) -> dict[str, int]:
    """A dedicated server's ShardServer.memory(): {"params", "optimizer", "exchange"} (module docstring;
    "exchange" exact when synchronous, a bound when asynchronous)."""
    servers, trainers = layout.ps_servers, layout.dp
    sizes = buckets(model, servers, int(bucket_mb * 2**20))
    mine = ELEMENT * sum(sizes) // servers
    held = trainers if layout.ps_mode == "sync" else layout.staleness + 2
    return {"params": mine, "optimizer": 2 * mine + STEP_BYTES * len(sizes), "exchange": held * mine}


def step_bytes(model: ModelConfig, layout: Layout, *, bucket_mb: float = 25.0) -> dict[str, int]:
    """Bytes of one step: a trainer's push and pull, a server's in and out (message bodies; each header
    adds ~100 bytes)."""
    servers = slice_count(layout)
    psi_bytes = ELEMENT * sum(buckets(model, servers, int(bucket_mb * 2**20)))
    if not layout.ps_servers:  # colocated: the others' slices out, theirs back
        moved = psi_bytes * (servers - 1) // servers
        return {"push": moved, "pull": moved, "server_in": moved, "server_out": moved}
    return {"push": psi_bytes, "pull": psi_bytes, "server_in": layout.dp * psi_bytes // servers,
            "server_out": layout.dp * psi_bytes // servers}


def exchange_time(model: ModelConfig, layout: Layout, hw: Hardware, *, bucket_mb: float = 25.0) -> float:
    """Seconds a step's push and pull take after backward (module docstring): each phase its busiest link.
    Dedicated servers are ranks after the trainers: the link is within a node only when all of them fit."""
    moved = step_bytes(model, layout, bucket_mb=bucket_mb)
    bw = hw.intra_node_bw if layout.world_size <= hw.devices_per_node else hw.inter_node_bw
    messages = len(buckets(model, slice_count(layout), int(bucket_mb * 2**20)))
    per_phase = max(moved["push"], moved["server_in"]) / bw
    return 2 * (per_phase + hw.latency_s * messages)
