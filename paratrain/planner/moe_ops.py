"""A MoE layer's compute by operation (paratrain.nn.moe as the engine runs it), for the per-operation model
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
"""

from __future__ import annotations

from paratrain.config.model import ModelConfig
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.ops import KERNELS, Gemm, Work, gemm_seconds

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
