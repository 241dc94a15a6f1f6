"""What Mixture-of-Experts layers cost the planner, in one room (as cp_cost.py is context parallelism's): what a
layer keeps for backward (moe_activation_bytes: paratrain.planner.activations adds it to the block that holds the
layer), its compute by operation (moe_layer_work, in place of a MoE block's MLP: paratrain.planner.ops), the bytes its
collectives move (expert_exchanges, expert_step_calls, sequence_parallel_moe: paratrain.planner.comm counts the rest)
and the time of expert parallelism's exchanges on the critical path (expert_exchange_time: paratrain.planner.timing).
The other terms ask it, or the layout (ParallelDims.experts_of, expert_index, experts_split), instead of reading ep.

Saved bytes. Bytes a Mixture-of-Experts layer (paratrain.nn.moe) keeps for backward: its router, dispatch, experts and
combine, as paratrain runs them (paratrain.planner.activations adds it to the block that holds the layer).

Compute. A MoE layer's compute by operation (paratrain.nn.moe as the engine runs it), for the per-operation model
(paratrain.planner.ops): what a GPU profile prices in place of a MoE block's MLP, per micro-batch on one rank.

    tokens    the rank routes its micro-batch's tokens (all of them on every tp rank: the layer is replicated
              over tp; its chunk, 1/tp, under sequence parallelism); a balanced router sends top_k
              assignments a token, and expert parallelism's all-to-alls leave every rank as many rows as it
              routed (tokens x top_k), spread over its E / ep experts; with expert_tp under sequence
              parallelism the rows are gathered over tp and each rank runs every row through 1/tp of each
              expert's width
    GEMMs     the router [tokens, d] x [d, E]; per local expert its up [rows, d] x [d, f_e] and down
              [rows, f_e] x [f_e, d] (f_e / tp with expert_tp), one product each: the loop over experts of
              nn.moe.Experts; the shared expert's MLP on the routed tokens
    memory    the router in float32 (the input upcast, a few passes over the [tokens, E] logits), the
              dispatch and combine of each assignment's row (gather, sort by expert, the experts' outputs
              concatenated and put back, weighted, summed over the k choices), under ep the runner's sort by
              destination and back, GELU over the experts' hidden, each weight gradient accumulated
    launches  the router and the bookkeeping, 4 a local expert (its slice, two products, GELU) forward and 10
              backward, the shared expert's; the layer runs eagerly in every mode (routing makes shapes that
              depend on the data), so compiled runs launch as many

Full recomputation runs the layer's forward again; selective recomputation does not touch it. Megatron's
grouped GEMMs and fused permutations are not modelled (no published MoE run is in the checks). Routing imbalance
is not modelled: the busiest rank's experts take more rows than the mean. Priced, not measured on a GPU.

Collectives. The bytes a Mixture-of-Experts model's layers add to a step (paratrain.planner.comm counts the rest), as the engine
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
from paratrain.planner.hardware import Hardware, bus_time
from paratrain.planner.layout import Layout
from paratrain.planner.ops import KERNELS, Gemm, Work, gemm_seconds

def moe_activation_bytes(model: ModelConfig, *, micro_batch: int, seq: int, mode: str = "fp32",
                         ep: int = 1, expert_tp: int = 1, gathered: bool = False, imbalance: float = 1.0) -> float:
    """Bytes a MoE layer (paratrain.nn.moe) keeps for backward, per micro-batch, its input included, when no
    assignment is dropped (dropless, or no expert over its capacity): an upper bound with a capacity. seq:
    the tokens of a sequence this rank routes (under sequence parallelism its chunk). Under expert parallelism
    each rank is taken to receive as many rows as it sends (a balanced router; a skewed one receives more) and
    to run each of its experts. expert_tp: the experts' width is cut over that many ranks; gathered: their
    rows all-gathered over them first (sequence parallelism). imbalance: under ep, the rows this rank receives over a
    balanced share (StepSettings.moe_imbalance). Exact to the byte for one process (tests); with expert_tp or sequence
    parallelism an estimate."""
    b, s, d, e, k, fe, f = micro_batch, seq, model.d_model, model.n_experts, model.top_k, model.expert_dim, model.ff_dim
    fe //= expert_tp
    n = b * s
    rows = n * k  # assignments that run
    res = 2 if mode == "low" else 4  # the residual stream's element
    mm = 4 if mode == "fp32" else 2  # a matmul's output element
    # router, in float32 (also under autocast): its input (the normed x itself; with 16-bit storage a
    # float32 copy, and one of its weight), logits (logsumexp's input) and probabilities (softmax's
    # output; sigmoid's output and the sum that normalises it), the log-sum-exp, the top-k's indices, and with k > 1
    # (or sigmoid scores) the chosen weights and their sum; f of the balance loss per sequence. Groups, the scale
    # and the balancing bias keep nothing (the choice is made on detached scores; the scale multiplies by a number)
    sigmoid = model.router == "sigmoid"  # its probabilities are the scores over their sum (one more per token)
    router = 4 * n * d + (4 * e * d if mode == "low" else 0)
    router += 8 * n * e + 4 * n + 8 * n * k + ((n * k + n) * 4 if k > 1 or sigmoid else 0) + 4 * b * e
    router += 4 * n if sigmoid else 0
    # dispatch: the token of each assignment, the order grouping rows by expert (and, under ep, the order
    # grouping what arrived by expert), each assignment's place; the rows the experts read, their
    # hidden activations (GELU's input and output), and under autocast each expert's weight copies
    received = rows * (imbalance if ep > 1 else 1.0)  # under ep: the rows that arrive here
    run = received * (expert_tp if gathered else 1)  # rows the experts run here
    dispatch = 8 * rows * 3 + (8 * received if ep > 1 else 0) + run * d * mm + 2 * run * fe * mm
    if mode == "autocast":
        dispatch += 2 * (e // ep) * fe * d * 2
    # combine: the experts' outputs put back in place (each index_copy keeps its source: under ep the
    # outputs by source rank and by assignment after the return trip; the layer's, in the residual's
    # dtype), the capacity mask (bool), the gates times it, the k outputs of each token
    combine = (rows + (received if ep > 1 else 0)) * d * mm + rows * d * res + n * k + n * k * res + n * k * d * res
    shared = 0.0
    if model.shared_expert:  # a dense MLP: its input (fp32: the router's; else a 16-bit one), GELU's
        shared = (0 if mode == "fp32" else n * d * 2) + 2 * n * f * mm  # input and output
        if mode == "autocast":
            shared += 2 * 2 * d * f
    return router + dispatch + combine + shared


ROW_UNITS = (26.0, 52.0)
"""Bytes per element of an assignment's row [d], (forward, backward), in 16-bit units (x act / 2): the gather of
the token's row, the sort by expert, the outputs concatenated, put back in assignment order (zeros and the copy),
weighted and summed over the k choices: 13 reads and writes forward, twice that backward."""
EP_ROW_UNITS = (8.0, 16.0)
"""The same under expert parallelism, for the runner's sort of the rows by destination rank and back."""
ROUTER_BYTES = (80.0, 160.0)
"""Bytes per router logit [tokens, E], float32: logits, softmax, top-k, the gate's renormalisation, the balancing
and z-loss terms (about ten passes), twice backward."""
KERNELS_FIXED = (30, 60)
"""The router, its losses and the bookkeeping (nonzero, argsort, bincount, index copies, the weighted sum)."""


def moe_layer_work(model: ModelConfig, layout: Layout, hw: Hardware, *, tokens: int, act: int, kernels: str) -> Work:
    """One MoE layer and one micro-batch of `tokens` rows on one rank (module docstring)."""
    h, experts, k, tp = model.d_model, model.n_experts, model.top_k, layout.tp
    routed = tokens // tp if layout.sequence_parallel else tokens
    rows = routed * k  # assignments this rank runs after the all-to-alls (a balanced router)
    width = model.expert_dim
    if layout.expert_tp and tp > 1:
        width //= tp
        if layout.sequence_parallel:
            rows *= tp  # the rows gathered over tp
    local = experts // layout.ep
    per_expert = max(1, rows // local)
    gemms = [Gemm(routed, experts, h)] + [Gemm(per_expert, width, h), Gemm(per_expert, h, width)] * local
    if model.shared_expert:
        gemms += [Gemm(routed, model.ff_dim, h), Gemm(routed, h, model.ff_dim)]
    g_fwd, g_bwd = gemm_seconds(hw, gemms)
    eager = KERNELS["eager"].element_bytes["ffn"]
    hidden = rows * width + (routed * model.ff_dim if model.shared_expert else 0)
    row_units = [ROW_UNITS[i] + (EP_ROW_UNITS[i] if layout.ep > 1 else 0.0) for i in (0, 1)]
    memory = [(routed * k * h * row_units[i] + hidden * eager[i]) * act / 2 + routed * experts * ROUTER_BYTES[i]
              + routed * h * (act + 4) for i in (0, 1)]  # (+ the input upcast for the router, and its gradient back)
    params = h * experts + local * 2 * h * width + (2 * h * model.ff_dim if model.shared_expert else 0)
    memory[1] += params * KERNELS[kernels].accumulate_bytes
    shared = 4 if model.shared_expert else 0
    launches = [KERNELS_FIXED[0] + 4 * local + shared, KERNELS_FIXED[1] + 10 * local + 2 * shared]
    forward = Work(g_fwd, 0.0, memory[0] / hw.memory_bw, launches[0] * hw.launch_s)
    work = forward + Work(g_bwd, 0.0, memory[1] / hw.memory_bw, launches[1] * hw.launch_s)
    return work + forward if layout.recompute == "full" else work


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


def layer_activation_bytes(model: ModelConfig, layout: Layout, *, micro_batch: int, seq: int, mode: str,
                           imbalance: float = 1.0) -> float:
    """moe_activation_bytes of one MoE layer of `layout` (seq: the tokens of a sequence this rank routes): its ep,
    its experts cut over tp with expert_tp, their rows gathered first under sequence parallelism."""
    return moe_activation_bytes(model, micro_batch=micro_batch, seq=seq, mode=mode, ep=layout.ep,
                                expert_tp=layout.tp if layout.expert_tp else 1,
                                gathered=layout.sequence_parallel and layout.expert_tp, imbalance=imbalance)


def expert_skew(layout: Layout, imbalance: float) -> float:
    """How many times a balanced share of the rows the busiest ep rank's experts run (StepSettings.moe_imbalance,
    a run's expert_load_factor): 1 without ep, where one rank runs every expert."""
    return imbalance if layout.ep > 1 else 1.0


def expert_exchange_time(model: ModelConfig, layout: Layout, hw: Hardware, *, tokens: int, act: int,
                         skew: float) -> list[tuple[int, float]]:
    """One MoE layer's exchanges in one micro-batch of `tokens` on this rank, on the critical path, as (calls,
    seconds a call): expert parallelism's rows to the experts and back, forward and backward (4 all-to-alls of
    tokens x top_k rows, a share (ep - 1) / ep leaving the rank, over the link its ep ranks, consecutive in dp, span;
    under sequence parallelism each tp rank sends its chunk's rows), and with expert_tp the experts' outputs summed
    over tp (an all-reduce each way of the rows; under sequence parallelism the rows all-gathered and the outputs
    reduce-scattered, and back in backward)."""
    tp = layout.tp
    rows_bytes = tokens * model.top_k * model.d_model * act  # a micro-batch's routed rows
    terms = []
    if layout.ep > 1:
        sent = rows_bytes / tp if layout.sequence_parallel else rows_bytes
        terms.append((4, bus_time(sent * skew, layout.ep, hw.bandwidth(layout.dims.inside("dp") * layout.ep),
                                  hw.latency_s, factor=1)))
    if layout.expert_tp and tp > 1:
        ops, factor = (4, 1) if layout.sequence_parallel else (2, 2)
        terms.append((ops, bus_time(rows_bytes, tp, hw.bandwidth(tp), hw.latency_s, factor=factor)))
    return terms
