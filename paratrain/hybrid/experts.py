"""The engine's side of Mixture-of-Experts layers: their auxiliary losses in the step's loss, and the
step's routing statistics over the whole job.

The MoE layers of this rank's model write to the engine's RouterLog (paratrain.nn.moe). Per
step the engine resets it, sets the gradient scale the auxiliary terms receive in backward, and adds
this rank's auxiliary sum to its loss sum before the sums are reduced, so the reported loss is
(cross-entropy + auxiliary terms) over the global batch's tokens, whatever the layout.

Statistics (--log-json): the load-balancing and z-loss terms per token, the fraction of assignments
dropped by capacity, and the assignments per (layer, expert) over the global batch: min, max, coefficient of
variation (std / mean; 0 when perfectly balanced) and the load factor (max / mean: 1 when balanced; the busiest
expert's rows over a balanced router's, the measured imbalance to plan with). Summed over dp (each dp rank routed
its own tokens), then combined over pp (each stage holds its own layers); tp ranks hold the same, but
under sequence parallelism, where each routed its chunk of the sequence: then the auxiliary terms and the
counts are summed over tp as well (`split`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import all_reduce
from paratrain.nn.moe import MoE, RouterLog
from paratrain.topology.mesh import AxisGroup
from paratrain.topology.quorum import Quorum

MOE_KEYS = ("moe_balance_loss", "moe_z_loss", "moe_dropped_fraction", "expert_tokens_min", "expert_tokens_max",
            "expert_tokens_cv", "expert_load_factor")


def attach_router_log(model: nn.Module, *, routed: bool = False) -> RouterLog | None:
    """One RouterLog for every MoE layer of `model` (under its name); without MoE layers None, or an empty one
    when `routed` (a pipeline stage of a MoE model: it joins the statistics' collectives over pp all the same)."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]
    if not layers:
        return RouterLog() if routed else None
    log = RouterLog(moving={name: module.router for name, module in layers if module.router.moves})
    for name, module in layers:
        module.attach(log, name)
    return log


def add_step_aux(totals: torch.Tensor, log: RouterLog | None, split: AxisGroup | None) -> None:
    """Add the step's auxiliary loss terms to its loss sum totals[0]: this rank's tokens', summed over `split`
    (the tp ranks under sequence parallelism, each of which routed its chunk; collective over it). Nothing
    without MoE layers; under sequence parallelism every tp rank must call it."""
    if log is None or log.aux_sum is None:
        return
    total = log.aux_sum.clone()
    if split is not None:
        all_reduce(total, split)
    totals[0] += total


def routing_totals(log: RouterLog, device: torch.device, dp: AxisGroup | None, pp: AxisGroup | None,
                   split: AxisGroup | None = None, *, quorum: Quorum | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """([balance sum, z sum, dropped, assigned, count sum, count sum of squares, (layer, expert) slots, max count,
    -min count] of the step, over the job; this stage's layers' assignments per expert over the global batch, by
    name) (collective over dp and pp, and over `split`: the tp ranks under sequence parallelism; under fault
    tolerance also over the replica groups of the quorum, which may raise ReplicaLost before anything is applied).
    The counts are integers in float64, so their sums are exact in any order: what the balancing bias moves by."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.stack([log.balance_sum if log.balance_sum is not None else zero,
                        log.z_sum if log.z_sum is not None else zero,
                        log.dropped if log.dropped is not None else zero,
                        zero + float(log.assigned or 0)])
    names = sorted(log.expert_tokens)
    counts = (torch.stack([log.expert_tokens[name] for name in names])
              if log.expert_tokens else torch.zeros(0, 1, dtype=torch.float64, device=device))
    for group in (split, dp):  # one all-reduce per axis: the sums, then the counts
        if group is not None:
            both = torch.cat([sums, counts.reshape(-1)])
            all_reduce(both, group)
            sums, counts = both[:4], both[4:].view_as(counts)
    if quorum is not None:  # the global batch spans every live replica group
        both = torch.cat([sums, counts.reshape(-1)])
        quorum.reduce([both])
        sums, counts = both[:4], both[4:].view_as(counts)
    spread = torch.stack([counts.sum(), counts.pow(2).sum(), zero + counts.numel()])
    extremes = (torch.stack([counts.max(), -counts.min()]) if counts.numel()
                else torch.full((2,), -math.inf, dtype=torch.float64, device=device))
    if pp is not None:  # each stage its own layers: one sum, one max
        added = torch.cat([sums, spread])
        all_reduce(added, pp)
        sums, spread = added[:4], added[4:]
        all_reduce(extremes, pp, op=dist.ReduceOp.MAX)
    return torch.cat([sums, spread, extremes]), dict(zip(names, counts))


def routing_stats(values: list[float], tokens: float) -> dict[str, float]:
    """The JSON record's MoE entries from routing_totals (read) and the global batch's token count."""
    balance, z, dropped, assigned, total, squares, slots, top, neg_bottom = values
    mean = total / slots if slots else 0.0
    variance = max(squares / slots - mean * mean, 0.0) if slots else 0.0
    return {"moe_balance_loss": balance / tokens, "moe_z_loss": z / tokens,
            "moe_dropped_fraction": dropped / assigned if assigned else 0.0,
            "expert_tokens_min": -neg_bottom, "expert_tokens_max": top,
            "expert_tokens_cv": math.sqrt(variance) / mean if mean else 0.0,
            "expert_load_factor": top / mean if mean else 0.0}
