"""memory: a layout's device bytes at the busiest pipeline rank's peak (model states, saved activations,
transients; Muon's exchange after backward; a dedicated parameter server), the search's memory side
(paratrain.planner.search prices every candidate with it)."""

from __future__ import annotations

import functools
from typing import Any

from paratrain.config.model import ModelConfig
from paratrain.nn.loss import CHUNK_BYTES
import paratrain.planner.cp_cost as cp_cost
import paratrain.planner.param_server as param_server
from paratrain.planner.activations import activation_bytes, storage_mode
from paratrain.planner.grid import grid_cuts
from paratrain.planner.layout import Layout
from paratrain.planner.memory import model_state_bytes
from paratrain.planner.optimizer import exchange_bytes
from paratrain.planner.settings import BYTES, PRICED, StepSettings
from paratrain.topology.dims import ParallelDims

def memory(model: ModelConfig, layout: Layout, *, global_batch: int, seq: int,
           settings: StepSettings = PRICED, exact: bool = True) -> dict[str, float]:
    """Device bytes of the busiest pipeline rank at its peak (every dp and tp rank of a stage holds the same):
    model states in a step (the gradient buffers included), saved activations at the schedule's peak, and transients
    ("other": the logits' gradient and the chunked loss's float32 temporaries; ZeRO-3's gathered unit and the one
    prefetched; the gradient bucket being reduced). Offloaded optimizer state is in CPU memory, not counted. Under the
    parameter server the parts are a trainer's, "server" a dedicated server's whole, and "peak" the larger
    (paratrain.planner.param_server). "between_steps": what the rank holds while no step runs (parameters and
    optimizer state; the gradients too with keep_grads). settings: the engine's (PRICED: bf16, NCCL's
    reduce-scatter, AdamW). exact: Muon's exchange buffers from the exchange's own plan (else the search's estimate
    of them: paratrain.planner.optimizer)."""
    precision, bucket_mb, pp_split = settings.precision, settings.bucket_mb, settings.pp_split
    mode = storage_mode(precision, layout.zero)
    microbatches = global_batch // (layout.dp * layout.micro_batch)
    local = layout.local_tokens(seq)  # the tokens of a sequence this rank holds
    act = 4 if mode == "fp32" else 2
    best: dict[str, float] = {}
    served = layout.ps_mode != "off"
    for stage in sorted({0, layout.pp // 2, layout.pp - 1}):
        if served:  # a trainer of the parameter server (paratrain.planner.param_server)
            states = param_server.trainer_state_bytes(model, layout, bucket_mb=bucket_mb,
                                                      keep_grads=settings.keep_grads)
        else:
            states = dict(_states(model, layout.dims, layout.zero, layout.expert_tp, layout.schedule, layout.offload,
                                  stage, settings))
        between = states["between_steps"] - (states["optimizer"] if layout.offload else 0)
        states = {k: states[k] for k in ("params", "grads", "optimizer")}
        if layout.offload:
            states = {**states, "optimizer": 0}
        activations = _activations(model, layout, seq, mode, stage, microbatches, tuple(pp_split),
                                   settings.moe_imbalance)
        tokens = layout.micro_batch * local
        # the bucket being reduced (a push sends the gradients' own slices: nothing copied)
        other = 0.0 if served else min(bucket_mb * 2**20, states["grads"] or bucket_mb * 2**20)
        other += cp_cost.transient_bytes(model, layout, seq=seq, act=act)
        if stage == layout.pp - 1:  # the logits' gradient (compute dtype) and the loss's float32 chunks
            logits = tokens * model.padded_vocab / layout.tp
            other += logits * act + min(2 * CHUNK_BYTES, 2 * 4 * logits)
        if layout.zero == 3:  # the largest block, gathered, and the next one prefetched
            blocks = grid_cuts(layout)[2]  # tp, or a grid's blocks of each matrix
            unit = 4 * model.d_model ** 2 / blocks + max(
                2 * model.d_model * model.ff_dim / blocks,
                model.moe_layer_params(layout.dims.experts_of(model.n_experts)) / (layout.tp if layout.expert_tp else 1)
                if model.n_experts else 0)
            other += 2 * unit * BYTES[precision if mode == "low" else "fp32"]
        record = {**{k: float(v) for k, v in states.items()}, "activations": activations, "other": other}
        record["peak"] = sum(record.values())
        if settings.optimizer == "muon" and not served:  # after backward: the exchange's buffers, not activations
            record["exchange"] = float(exchange_bytes(model, layout, stage=stage, settings=settings, exact=exact))
            record["peak"] = max(record["peak"], record["peak"] - activations - other + record["exchange"])
        record["between_steps"] = float(between)
        if record["peak"] > best.get("peak", -1.0):
            best = record
    if layout.ps_servers:  # a dedicated server: its slices, their AdamW state, the pushes it holds
        best["server"] = float(sum(param_server.server_state_bytes(model, layout, bucket_mb=bucket_mb).values()))
        best["peak"] = max(best["peak"], best["server"])
    return best


# The search asks for the same terms many times: model states do not depend on the micro-batch, recompute,
# sequence parallelism or cp's mode; saved activations not on the ZeRO stage (its storage mode is passed). Each is
# cached on what it reads.
@functools.lru_cache(maxsize=1 << 16)
def _states(model: ModelConfig, dims: ParallelDims, zero: int, expert_tp: bool, schedule: str, offload: bool,
            stage: int, settings: StepSettings) -> dict[str, int]:
    layout = Layout(dims=dims, zero=zero, expert_tp=expert_tp, schedule=schedule, offload=offload)
    return model_state_bytes(model, layout, stage=stage, settings=settings)


_SAVED: dict[tuple[Any, ...], float] = {}


def _activations(model: ModelConfig, layout: Layout, seq: int, mode: str, stage: int, microbatches: int,
                 pp_split: tuple[int, ...], moe_imbalance: float) -> float:
    """activation_bytes, cached on the fields it reads (ZeRO 1, 2 and 3 share their dims and storage mode)."""
    key = (model, layout.saved_fields, layout.schedule, seq, mode, stage, microbatches, pp_split, moe_imbalance)
    if key not in _SAVED:
        if len(_SAVED) >= 1 << 16:
            _SAVED.clear()
        _SAVED[key] = activation_bytes(model, layout, seq=seq, mode=mode, stage=stage, microbatches=microbatches,
                                       pp_split=pp_split, moe_imbalance=moe_imbalance)
    return _SAVED[key]

