"""Step time of a layout: compute at the hardware's rates, the pipeline bubble, and the communication
of each axis over the links it crosses (Narayanan et al. 2021, section 3; Korthikanti et al. 2022,
section 4), each term named so that a measurement can be set against it.

    compute    on a GPU profile with per-operation rates (Hardware.per_operation), the busiest pipeline rank's
               GEMMs, attention, memory-bound operations and kernel launches per micro-batch, and once per
               step its optimizer (paratrain.planner.ops; a MoE layer's routing, dispatch and experts:
               paratrain.planner.moe_cost). Otherwise (the CPU profile, one efficiency): model
               FLOPs (6 N per token + attention, PaLM's count) of the busiest pipeline stage, times 4/3 with
               full recomputation (one more forward), over peak x efficiency; plus the profile's fixed
               overhead per block and micro-batch (launches, Python), and per MoE layer and micro-batch what
               routing adds to it (the router, top-k, the sort, per-expert launches)
    tp         per block and micro-batch 4 all-reduces of b s h (2 forward, 2 backward; sequence
               parallelism: 4 all-gathers and 4 reduce-scatters, and 2 all-gathers again in
               backward), with full recomputation the forward's again as far as backward needs them: on
               the critical path, so added to each micro-batch's time. The grid modes (2d,
               2.5d, 3d): every collective paratrain.planner.grid lists for the blocks (and the head without pp),
               each over the links its sub-axis spans
    bubble     the schedule's idle share (paratrain.pipeline.schedules.Schedule.bubble), stretching
               the pipelined time
    pp         an activation forward and a gradient backward per micro-batch and stage boundary; the
               steady state hides them, the fill and drain do not: 2 (p - 1) transfers exposed
    ep         per MoE layer and micro-batch 4 all-to-alls of the routed rows (b s k h): on the
               critical path; MoE layers are replicated over tp, so their compute is not divided by tp
    cp         each rank computes seq / cp tokens' share (the balanced split gives every rank the same
               attention work); per block and micro-batch, ring: cp - 1 hops of this rank's K/V block in
               forward, and in backward cp - 1 again with the (dK, dV) accumulators beside them, each hop
               overlapping one block of attention compute (only what it takes longer is exposed), and the
               accumulators' last hop home; Ulysses: 4 all-to-alls of b s/cp h (q, k, v, out) each way,
               on the critical path; USP: Ulysses' all-to-alls over its U ranks, then a ring of cp / U
               hops, each the same bytes as a ring hop at cp and overlapping U times a ring step's compute
    dp         the traffic paratrain.planner.comm counts for the engine: zero 0 an all-reduce of float32
               gradients, zero 1 a reduce-scatter and an all-gather once, ZeRO-2 and 3 a reduce-scatter per
               micro-batch (once under pp), ZeRO-3's gathers per micro-batch (each block for its forward and
               its backward, the root once); overlapped with the last micro-batch's backward (zero 0 and 1),
               every micro-batch's backward (ZeRO-2) or all compute (ZeRO-3's prefetched gathers), not under
               pp (the reduction follows the schedule); the profile's overlap_loss of the overlapped time is
               still paid (compute slowed while a collective runs under it)
    ps         the parameter server instead: the push and the pull after backward, each over the busiest
               link (paratrain.planner.param_server.exchange_time), not overlapped; the trainers are the dp
               ranks, and MFU counts the dedicated servers among the devices

Links: ranks are laid out tp innermost, then cp, then dp, then pp (paratrain.topology.dims), so a tp
group is inside a node when tp <= devices per node, a cp group when tp x cp <= devices per node, a dp
group when tp x cp x dp <= devices per node, and pp only when the whole world fits in a node.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.model_rules import check_float8_layout
from paratrain.pipeline.schedules import Schedule
import paratrain.planner.cp_cost as cp_cost
from paratrain.planner.float8 import float8_speedup, linear_flops_per_token
from paratrain.planner.grid import grid_time
from paratrain.planner.hardware import Hardware, bus_time
from paratrain.planner.held import rank_held, stepped_elements
from paratrain.planner.layout import Layout, chunk_layers, layer_costs, stage_chunks
from paratrain.planner.memory import BYTES
from paratrain.planner.moe_cost import expert_exchange_time, expert_skew, moe_layer_work
from paratrain.planner.ops import KERNELS, Numerics, Work, rank_work
from paratrain.planner.param_server import exchange_time
from paratrain.planner.settings import PRICED, StepSettings
from paratrain.topology.dims import ParallelDims

@dataclass(frozen=True)
class StepTime:
    step_s: float
    compute_s: float
    """Compute of the busiest stage, bubble excluded."""
    comm_s: float
    """Communication on the critical path: tp, ep's all-to-alls, cp's exposed exchange, the exposed part of dp,
    pp's fill and drain."""
    bubble: float
    """The schedule's idle share of the pipelined part."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs per second over the peak of every device."""
    terms: dict[str, float] = field(default_factory=dict)
    """The step time by term (module docstring), seconds: they add up to step_s (`paratrain plan --explain`)."""


@functools.lru_cache(maxsize=4096)
def _stages(model: ModelConfig, pp: int, v: int, pipeline: Schedule | None) -> tuple[float, int, int]:
    """The busiest pipeline rank's share of the model's work (layers are split by these costs), the most blocks a
    rank runs (an MTP depth's block counted with the head's rank), and the most of the model's own blocks."""
    dims = ParallelDims(pp=pp, virtual_stages=v)
    costs = layer_costs(model)
    ranges = chunk_layers(model, dims)
    mine = [stage_chunks(dims, r, pipeline) for r in range(pp)]
    share = max(sum(sum(costs[slice(*ranges[c])]) for c in chunks) for chunks in mine) / sum(costs)
    trunk = [sum(len(range(max(ranges[c][0], 1), min(ranges[c][1], model.n_layer + 1))) for c in chunks)
             for chunks in mine]
    mtp = [model.mtp_depth * any(ranges[c][1] == model.n_layer + 2 for c in chunks) for chunks in mine]
    return share, max(t + m for t, m in zip(trunk, mtp)), max(trunk)


def _data_parallel_time(model: ModelConfig, layout: Layout, hw: Hardware, *, compute: float, micro_batches: int,
                        precision: str, grad_reduce: str, float8_gathers: bool = False) -> tuple[float, float]:
    """Seconds of data-parallel traffic per step, as paratrain.planner.comm counts it for the engine, and how much
    of them runs under compute (module docstring). The dense parameters are reduced over dp x cp; under ZeRO with
    shard groups (MiCS / HSDP) reduce-scattered and gathered within a group of dp_shard x cp ranks and the shard
    all-reduced across the groups; the experts over their dp / ep replicas x cp (not at all when ep = dp)."""
    held, m = rank_held(model, layout), micro_batches
    dp, inside = layout.dp, layout.dims.inside("dp")  # the ranks inside one dp index (tp x cp)
    dense, expert = held.total - held.expert, held.expert
    # 16-bit gradients under ZeRO, as the published runs it is fitted to (--grad-dtype bf16; the default float32
    # buffers move twice the bytes: planner.comm counts them, this estimate does not yet); zero 0: float32
    elsize = BYTES[precision] if layout.zero else 4
    whole = inside * dp  # the ranks a dp group spans (and the experts' replicas, ep apart)
    replicas, expert_replicas = layout.dims.replicas, layout.dims.expert_replicas
    hierarchical = layout.zero and layout.shard_group is not None
    shard = layout.shards if hierarchical else replicas

    def bus(elements: float, ranks: int, span: int, factor: float) -> float:  # (no experts: no collective)
        return bus_time(elements * elsize, ranks, hw.bandwidth(span), hw.latency_s, factor=factor) if elements else 0.0

    def one_way(dense_elements: float, expert_elements: float) -> float:  # a reduce-scatter or an all-gather
        return bus(dense_elements, shard, inside * (layout.dims.dp_shard if hierarchical else dp), 1) + bus(
            expert_elements, expert_replicas, whole, 1)

    backward = (2.0 / 3.0) * compute  # every micro-batch's backward
    if not layout.zero or grad_reduce == "all_reduce":
        reduce = bus(dense, replicas, whole, 2) + bus(expert, expert_replicas, whole, 2)
    else:  # a reduce-scatter within the shard group (its shard then all-reduced across the groups)
        reduce = one_way(dense, expert) + (bus(dense / shard, dp // layout.dims.dp_shard, whole, 2)
                                          if hierarchical else 0.0)
    if not layout.zero:  # one all-reduce, under the last micro-batch's backward (after the schedule under pp)
        return reduce, min(reduce, backward / m if layout.pp == 1 else 0.0)
    reduce *= 1 if layout.zero == 1 or layout.pp > 1 else m  # ZeRO-2 and 3 reduce every micro-batch's gradients
    if layout.zero < 3:  # the updated shards gathered once, after the optimizer step (not under backward)
        window = 0.0 if layout.pp > 1 else (backward if layout.zero == 2 else backward / m)
        return reduce + one_way(dense, expert), min(reduce, window)
    # ZeRO-3: every micro-batch gathers each block for its forward and again for its backward (its recomputed
    # forward runs inside the backward's gather), the root once; prefetched under the compute of every micro-batch
    # (float8 gathers: the linear weights' two gathers in one byte each, one 16-bit gather's bytes)
    gathered = 2 * (dense - held.root) - (held.linear if float8_gathers else 0) + held.root
    traffic = reduce + m * one_way(gathered, 2 * expert)
    return traffic, min(traffic, compute)


def step_time(model: ModelConfig, layout: Layout, hw: Hardware, *, global_batch: int, seq: int,
              settings: StepSettings = PRICED, kernels: str = "eager") -> StepTime:
    """kernels: how the blocks run, for a per-operation profile (paratrain.planner.ops.KERNELS): eager,
    compiled (torch.compile) or Megatron's fused kernels. settings: what the step time reads of the engine's
    settings: the precision, ZeRO's reduction primitive, moe_imbalance (under ep the busiest rank's experts' work and
    received rows times it, which every rank waits for) and, under precision fp8, the blocks' float8 recipe
    (paratrain.planner.float8)."""
    precision, moe_imbalance = settings.precision, settings.moe_imbalance
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {sorted(KERNELS)} (how the blocks run: eager, compiled by "
                          f"torch.compile, or Megatron's fused kernels), got {kernels!r}")
    dp, tp, pp, v = layout.dp, layout.tp, layout.pp, layout.virtual_stages
    local = layout.local_tokens(seq)  # the tokens of a sequence this rank holds
    m = global_batch // (dp * layout.micro_batch)  # micro-batches per rank and step
    tokens = global_batch * seq
    model_flops = model.flops_per_token(seq) * tokens
    hardware_flops = model_flops * (4.0 / 3.0 if layout.recompute == "full" else 1.0)
    if layout.recompute == "selective":  # the attention core's forward again: a third of its 12 L d s
        hardware_flops += 4.0 * model.n_layer * model.d_model * seq * tokens
    share, blocks_here, trunk_here = _stages(model, pp, v, layout.pipeline)
    rate = hw.peak_flops * hw.efficiency
    # MoE layers replicated over tp run whole on every tp rank (ep divides the rows, not the work); expert tensor
    # parallelism (each rank 1/tp of every expert) or sequence parallelism (each rank routes its chunk) divide them
    moe_flops = 6.0 * model.moe_layers * model.moe_layer_params(model.top_k) * tokens
    moe_flops *= hardware_flops / model_flops
    skew = expert_skew(layout, moe_imbalance)  # the busiest ep rank's experts run skew x a balanced share
    skewed = (skew - 1.0) * 12.0 * model.moe_layers * model.top_k * model.d_model * model.expert_dim * tokens * (
        hardware_flops / model_flops)
    moe_tp = tp if layout.expert_tp or layout.sequence_parallel else 1
    float8 = settings.fp8_recipe if precision == "fp8" else ""
    if float8:  # the blocks' linears at the float8 rate (their casts: priced by operation only)
        check_float8_layout(layout.dims)
        hardware_flops -= linear_flops_per_token(model) * tokens * hardware_flops / model_flops * (
            1.0 - 1.0 / float8_speedup(hw.name, hw.float8_speedup))
    per_rank = (hardware_flops - moe_flops) / layout.dims.inside("pp") + (moe_flops + skewed) / (
        layout.dims.replicas * moe_tp)
    moe_here = round(model.moe_layers * trunk_here / model.n_layer) if model.n_experts else 0
    # the profile's fixed time per block and micro-batch, and a MoE layer's own beyond it (routing, sorting)
    overhead = (hw.overhead_s * blocks_here + hw.moe_overhead_s * moe_here) * m
    compute = per_rank * share / rate + overhead
    act = BYTES[precision]
    by_operation = {"compute: FLOPs at peak x efficiency": compute - overhead, "compute: fixed overhead": overhead}
    once = 0.0  # the per-operation model's optimizer step, after the pipelined part
    attention_rate = rate
    if hw.per_operation:  # paratrain.planner.ops (and a MoE layer's: paratrain.planner.moe_cost)
        # the optimizer steps on this device over its ZeRO shard (not when offloaded, nor under the parameter server)
        stepped = stepped_elements(model, layout)
        moe = moe_layer_work(model, layout, hw, tokens=layout.micro_batch * local, act=act,
                             kernels=kernels) * skew if model.n_experts else Work()
        work, optimizer = rank_work(model, layout, hw, micro_batches=m, seq=seq, numerics=Numerics(kernels, act, float8),
                                    stage_elements=stepped, moe_layer=moe)
        compute, once = work.total, optimizer.total
        attention_rate = hw.peak_flops * hw.attention_efficiency
        by_operation = {"compute: GEMMs": work.gemm, "compute: attention": work.attention,
                        "compute: memory-bound ops": work.memory, "compute: kernel launches": work.launches,
                        "optimizer step": once}
    # tensor parallelism, on the critical path, per block and micro-batch: 4 all-reduces of b s h; with
    # sequence parallelism 4 all-gathers and 4 reduce-scatters (each half an all-reduce's traffic)
    # and 2 more all-gathers in backward (the column layers keep only their slice of the input)
    tp_bytes = layout.micro_batch * local * model.d_model * act
    # (full recomputation runs the forward's again as far as backward needs it: paratrain 1 all-reduce, or 2
    # all-gathers and 1 reduce-scatter, as planner.comm counts them to the byte; Megatron's fused runs the whole
    # forward's, 2 all-reduces, or 2 all-gathers and 2 reduce-scatters whose inputs backward then keeps)
    full, megatron = layout.recompute == "full", kernels == "fused"
    if layout.sequence_parallel:  # all-gathers and reduce-scatters
        count = (12 if megatron else 13) if full else 10
        per_block = count * bus_time(tp_bytes, tp, hw.bandwidth(tp), hw.latency_s, factor=1)
    else:  # all-reduces
        count = (6 if megatron else 5) if full else 4
        per_block = count * bus_time(tp_bytes, tp, hw.bandwidth(tp), hw.latency_s, factor=2)
    tp_time = m * blocks_here * per_block
    if layout.dims.tp_grid and tp > 1:  # a grid's collectives, each over the links its sub-axis spans; its
        # head's SUMMA too (its weight term is large): paratrain.planner.grid
        tp_time = m * grid_time(model, layout, hw, blocks=blocks_here, last=pp == 1, act=act, seq=local)
    cp_time = m * blocks_here * cp_cost.exchange_time(model, layout, hw, seq=seq, act=act, rate=attention_rate)
    # the MoE layers' exchanges on the critical path, per layer and micro-batch (paratrain.planner.moe_cost)
    ep_time = 0.0
    for calls, seconds in expert_exchange_time(model, layout, hw, tokens=layout.micro_batch * local, act=act,
                                               skew=skew):
        ep_time += m * moe_here * calls * seconds
    bubble = layout.pipeline.bubble(m) if layout.pipeline is not None else 0.0
    pipelined = (compute + tp_time + ep_time + cp_time) / (1.0 - bubble)
    # pipeline: the fill and drain expose 2 (p - 1) transfers of an activation (or its gradient)
    pp_time = 2 * (pp - 1) * (hw.latency_s + tp_bytes / tp / hw.bandwidth(layout.world_size)) if pp > 1 else 0.0
    dp_time, overlap = _data_parallel_time(model, layout, hw, compute=compute, micro_batches=m, precision=precision,
                                           grad_reduce=settings.grad_reduce, float8_gathers=float8 == "tensorwise")
    # what overlaps compute is hidden but for the profile's overlap loss (compute slowed while it runs)
    dp_exposed = dp_time - overlap + hw.overlap_loss * overlap
    if layout.ps_mode != "off":  # the push and the pull after backward (paratrain.planner.param_server)
        dp_exposed = exchange_time(model, layout, hw)
    step = pipelined + once + pp_time + dp_exposed
    terms = {**by_operation, "tp collectives": tp_time, "ep all-to-alls": ep_time, "cp exchange": cp_time,
             "pipeline bubble": pipelined - (compute + tp_time + ep_time + cp_time), "pp fill and drain": pp_time,
             "dp (or parameter server) exposed": dp_exposed}
    return StepTime(step_s=step, compute_s=compute + once, comm_s=tp_time + ep_time + cp_time + pp_time + dp_exposed,
                    bubble=bubble, tokens_per_s=tokens / step,
                    mfu=model_flops / step / (layout.world_size * hw.peak_flops), terms=terms)
