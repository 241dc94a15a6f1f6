"""The bytes a Mixture-of-Experts model's layers add to a step (paratrain.planner.comm counts the rest), as the engine
issues them with routing spread evenly over the experts (what planning assumes, and what a dry run on the meta device
does: it has no expert ids). Checked to the byte by `paratrain plan --dry-run` (tests/unit/test_dryrun.py).

    ep          per MoE layer and micro-batch: the counts per expert (int64) and the rows to the experts and back,
                backward the rows' gradients both ways (each call counted by its input)
    cp          each MoE layer's per-sequence expert fractions summed over the cp ranks (float32)
    tp          a MoE layer is replicated over tp: its block lacks the MLP's collectives; under sequence parallelism
                each tp rank routes its chunk (its replicated weights' gradients summed over tp), with expert_tp the
                chunks' rows are gathered for the experts and their outputs reduce-scattered back
    once        the routing statistics over dp (and tp under sequence parallelism, and pp), the experts' parts of
                the gradient norm
"""

from __future__ import annotations

from collections import Counter

from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout

Call = tuple[str, str, int, int]
"""(axis, operation, elements, bytes an element), as paratrain.planner.comm counts calls."""


def expert_exchanges(model: ModelConfig, layout: Layout, *, moe: int, act: int,
                     w_again: int = 0) -> dict[str, tuple[str, int]]:
    """{axis: (operation, bytes)} of one micro-batch's exchanges on a pipeline rank holding `moe` MoE layers; act: the
    rows' element bytes. w_again: the MoE layers among them whose zero-bubble W walks the whole chunk again (a MoE
    layer's router returns no single tensor to take its weights' gradient from), sending the rows' gradients both
    ways again (and, recomputed, the forward's rows)."""
    exchanges: dict[str, tuple[str, int]] = {}
    if layout.dims.sequence_parts > 1 and moe:  # the sequence's parts' fractions summed
        exchanges["cp"] = ("all_reduce", moe * 2 * layout.micro_batch * model.n_experts * 4)
    if layout.ep > 1 and (moe or w_again):
        tokens = layout.micro_batch * layout.local_tokens(model.seq_len) // (layout.tp if layout.sequence_parallel else 1)
        rows = tokens * model.top_k * model.d_model * act  # (under sequence parallelism each tp rank its chunk's)
        forward = model.n_experts * 8 + 2 * rows  # a recomputed block (full) exchanges its forward's again
        recomputed = layout.recompute == "full"  # (W's walk recomputes the block's forward once more)
        exchanges["ep"] = ("all_to_all", moe * (forward * (2 if recomputed else 1) + 2 * rows)
                           + w_again * (2 * rows + (forward if recomputed else 0)))
    return exchanges


def expert_step_calls(model: ModelConfig, layout: Layout, *, moe: int) -> list[Call]:
    """A MoE model's collectives once a step on a pipeline rank holding `moe` MoE layers: the routing statistics
    (four sums and the rank's per-(layer, expert) counts, float64; paratrain.hybrid.experts.routing_totals) over dp
    (and over tp under sequence parallelism, with the auxiliary sum), their sums and extremes over pp; the experts'
    parts of the gradient norm under ep (their own placement; with expert_tp their tp slices too)."""
    calls: list[Call] = []
    if layout.sequence_parallel and layout.tp > 1:
        calls += [("tp", "all_reduce", 1, 8), ("tp", "all_reduce", 4 + moe * model.n_experts, 8)]
    if layout.dims.replicas > 1:
        calls.append((layout.dims.data_axis, "all_reduce", 4 + moe * model.n_experts, 8))
    parts = 1 + layout.expert_tp if layout.ep > 1 else 0
    if layout.pp > 1:
        calls += [("pp", "all_reduce", 7, 8), ("pp", "all_reduce", 2, 8)] + [("pp", "all_reduce", 1, 4)] * parts
    if layout.ep > 1:
        calls += [("ep", "all_reduce", 1, 4)] * parts
    if layout.expert_tp and layout.ep > 1 and layout.tp > 1:
        calls.append(("tp", "all_reduce", 1, 4))
    if layout.zero and layout.ep > 1 and layout.expert_shards > 1:
        calls += [(layout.dims.expert_data_axis, "all_reduce", 1, 4)] * parts
    return calls


def sequence_parallel_moe(model: ModelConfig, layout: Layout, calls: list[Call], *, moe: int, full: int,
                          act: int, w_moe: int = 0) -> list[Call]:
    """A micro-batch's tp collectives `calls`, counted as if every block were dense, with `moe` of them MoE layers
    under sequence parallelism: each routes its own chunk of the sequence (the MLP's gathers and scatters gone; a
    recomputed forward gathers for its attention only), sums its per-sequence fractions over tp, and has its
    replicated weights' gradients summed over tp (the router, the shared expert, and the experts unless expert_tp cuts
    them); with expert_tp the chunks' counts and rows are gathered over tp for the experts and their outputs
    reduce-scattered back, forward and backward. full: a gathered activation's elements. w_moe: the MoE layers among
    them whose zero-bubble W repeats the backward (counted as a dense MLP's two gathers and one scatter)."""
    if not moe:
        return calls
    counts = Counter(calls)
    full_recompute = layout.recompute == "full"
    counts[("tp", "all_gather", full, act)] -= moe * (3 + full_recompute) + w_moe * (2 + full_recompute)
    counts[("tp", "reduce_scatter", full, act)] -= 2 * moe + w_moe
    counts[("tp", "all_reduce", layout.micro_batch * model.n_experts, 4)] += moe * (1 + full_recompute)
    d, local = model.d_model, model.n_experts // layout.ep
    replicated = [model.n_experts * d] + ([model.ff_dim * d] * 2 if model.shared_expert else [])
    if layout.expert_tp:
        rows = full * model.top_k
        counts[("tp", "all_gather", layout.tp * local, 8)] += moe
        counts[("tp", "all_gather", rows, act)] += 2 * moe
        counts[("tp", "reduce_scatter", rows, act)] += 2 * moe
    else:
        replicated += [local * model.expert_dim * d] * 2
    for numel in replicated:
        counts[("tp", "all_reduce", numel, act)] += moe
    return list(counts.elements())
