"""Bytes one rank moves in one training step, by axis and operation, exactly as paratrain issues
them, counted the way the ZeRO paper does (paratrain.comm.volume: an all-reduce of n bytes moves 2n,
a reduce-scatter whose input is n bytes or an all-gather whose output is n moves n; a pipeline send
of n bytes moves n).

Data parallelism: paratrain.planner.dp_comm (gradients and parameters over dp, the experts' over edp).

Tensor parallelism (`tensor_parallel_calls`), per micro-batch, A = micro-batch x seq x d_model:
    without sequence parallelism (Megatron): per block an all-reduce of A after attention and after
              the MLP, and one of each column input's gradient in backward (4); the vocab-parallel
              embedding's output (first stage), the head's input gradient (last stage)
    with it (Korthikanti et al.): per block, forward: the column inputs all-gathered (2), the row
              outputs reduce-scattered (2); backward: the column inputs all-gathered again (only the
              sequence slice is kept), the row output gradients all-gathered, the column input
              gradients reduce-scattered (4 all-gathers, 2 reduce-scatters); the embedding's output
              reduce-scattered (its gradient all-gathered), the head a gathered column; and every
              replicated weight's gradient ([d_model]: the two norms per block, the final norm)
              summed over tp as backward produces it
    full recompute runs a block's forward again in backward, up to the last tensor backward needs
              (torch.utils.checkpoint stops early): one row output's all-reduce (reduce-scatter) and,
              with sequence parallelism, both column gathers; selective recompute moves nothing more
    the vocab-parallel loss (last stage): three all-reduces of [micro-batch x seq] in float32
    zero-bubble splits backward into I (input gradients) and W (weight gradients), and W repeats
              tensor-parallel traffic on every stage but the first (whose I has nothing to do): with
              recompute, W walks the chunk's whole backward again (a recomputed block's forward
              too); without it, each module's own weight-gradient pass, which moves nothing without
              sequence parallelism and, with it, what the gathered columns' and the rows' backward
              move (4 all-gathers and 2 reduce-scatters per block, the head's gather and scatter)
The grid modes (2d, 2.5d, 3d): paratrain.planner.grid, over their sub-axes (tp_row, tp_col, tp_depth; tp_input,
    tp_weight, tp_output).
Pipeline: each micro-batch's activation [micro-batch, seq (/ tp under sequence parallelism), d_model]
    sent forward from every chunk but the last, its gradient backward from every chunk but the first;
    the tied embedding's gradient (its shard under ZeRO) all-reduced between the first and last stage.
Scalars: the loss's (sum, count) in float64 over dp and over pp; the gradient norm's sums of squares
    (one float32 per part of the norm, a part being the parameters that add up over the same axes:
    tensor-parallel slices and replicated weights) over the ZeRO shard group, tp and pp.

The dtypes are the engine's on the meta device, which runs no autocast: activations in the stored
parameters' dtype (16 bits under ZeRO with bf16, float32 otherwise). Under zero 0 with bf16 a real
run's autocast moves the row outputs in bf16: the float32 counted here is then an upper bound.
`paratrain plan --dry-run` runs a step on the meta device and checks its recorded collectives and
pipeline sends against `step_volume`, byte for byte (tests/unit/test_dryrun.py, up to 1,024 ranks).
"""

from __future__ import annotations

from collections import Counter

from paratrain.config.model import ModelConfig
import paratrain.planner.cp_cost as cp_cost
from paratrain.planner.dp_comm import data_parallel_volume
from paratrain.planner.grid import grid_calls, grid_cuts, norm_parts, width_axes
from paratrain.planner.moe_cost import Call, expert_exchanges, expert_step_calls, sequence_parallel_moe
from paratrain.planner.layout import Layout, chunk_layers
from paratrain.planner.params import rank_params
from paratrain.planner.memory import flat_groups
from paratrain.planner.settings import BYTES, StepSettings

_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "send": 1, "broadcast": 1, "reduce": 1}
# a Call: (axis, op, elements of the full tensor (all-reduce buffer, reduce-scatter input, all-gather output,
# message), bytes per element)


def step_volume(model: ModelConfig, layout: Layout, *, stage: int, micro_batches: int,
                settings: StepSettings = StepSettings()) -> dict[str, dict[str, int]]:
    """{axis: {op: bytes}} pipeline rank `stage` moves in one step of `micro_batches` micro-batches
    (every dp and tp rank of a stage moves the same): axes "dp" ("dp_cp" under context parallelism: the
    dp x cp ranks holding the same parameters), "tp", "cp" (Ulysses' all-to-alls; USP's on "cp_ulysses"), "pp" (its op
    "send": the point-to-point messages) and "tied" (the embedding shared by the first and last stage). Ring
    attention's point-to-point messages are not in it (paratrain.context_parallel.ring counts them)."""
    precision, pp_split = settings.precision, settings.pp_split
    volume = data_parallel_volume(model, layout, stage=stage, micro_batches=micro_batches, settings=settings)
    # per micro-batch without zero bubble's W repeats, then each chunk's W repeats as many times as its W runs
    w_runs = w_counts(layout, stage, micro_batches)
    base = Counter(tensor_parallel_calls(model, layout, stage=stage, precision=precision, pp_split=pp_split,
                                         w_chunks=()))
    calls = Counter({call: n * micro_batches for call, n in base.items()})
    for chunk, runs in w_runs.items():
        with_w = Counter(tensor_parallel_calls(model, layout, stage=stage, precision=precision, pp_split=pp_split,
                                               w_chunks=(chunk,)))
        calls.update({call: (n - base[call]) * runs for call, n in with_w.items() if n > base[call]})
    calls.update(step_calls(model, layout, stage=stage, precision=precision, bucket_mb=settings.bucket_mb,
                            pp_split=pp_split, grad_bytes=settings.grad_bytes(layout)))
    for (axis, op, numel, size), n in calls.items():
        ops = volume.setdefault(axis, {})
        ops[op] = ops.get(op, 0) + n * _FACTOR[op] * numel * size
    blocks, _, last = _held(model, layout, stage, pp_split)
    for axis, sequence_ops in cp_cost.step_volume(model, layout, blocks=blocks, last=last, micro_batches=micro_batches,
                                                  act=_activation_bytes(layout, precision)).items():
        ops = volume.setdefault(axis, {})  # cp's own: Ulysses' all-to-alls, the MTP depths' ids gathered
        for op, n in sequence_ops.items():
            ops[op] = ops.get(op, 0) + n
    if model.n_experts:  # ep's all-to-alls, cp's per-sequence fractions (paratrain.planner.moe_cost)
        moe, act = _moe_layers(model, layout, stage, pp_split), _activation_bytes(layout, precision)
        # each micro-batch's exchanges, then each W's repeat of its chunk's backward ones
        runs = [(moe, 0, micro_batches)] + [(0, _w_repeats(model, layout, stage, pp_split, (c,))[2], n)
                                             for c, n in w_runs.items()]
        for layers, again, times in runs:
            for axis, (op, n) in expert_exchanges(model, layout, moe=layers, act=act, w_again=again).items():
                volume.setdefault(axis, {})[op] = volume.get(axis, {}).get(op, 0) + n * times
    sent = pipeline_sends(model, layout, stage=stage, micro_batches=micro_batches, precision=precision,
                          pp_split=pp_split)
    if sent:
        volume.setdefault("pp", {})["send"] = sent
    return volume


def tensor_parallel_calls(model: ModelConfig, layout: Layout, *, stage: int, precision: str = "fp32",
                          pp_split: tuple[int, ...] = (), w_chunks: tuple[int, ...] | None = None) -> list[Call]:
    """The tp collectives of one micro-batch on pipeline rank `stage` (empty when tp is 1), with zero bubble's W
    repeats of the chunks `w_chunks` (None: every chunk whose W repeats traffic, as when every micro-batch's
    backward is split)."""
    if layout.tp == 1:
        return []
    blocks, first, last = _held(model, layout, stage, pp_split)
    act = _activation_bytes(layout, precision)
    if layout.dims.tp_grid:  # 2d, 2.5d, 3d: paratrain.planner.grid
        return grid_calls(model, layout, blocks=blocks, first=first, last=last, act=act)
    # the MTP depths run with the head, each a block, an embedding lookup and the head (with its loss) again; under
    # sequence parallelism their two input norms and projection are replicated weights summed over tp too
    depths = model.mtp_depth if last else 0
    first, last = int(first) + depths, int(last) + depths  # (_held counts their blocks)
    tokens = layout.micro_batch * layout.local_tokens(model.seq_len)  # this rank's tokens
    full = tokens * model.d_model
    again = blocks if layout.recompute == "full" else 0
    # zero-bubble's W: the backward's traffic once more, on the chunks whose I does something (not chunk 0's)
    w_blocks, w_head, w_moe = _w_repeats(model, layout, stage, pp_split, w_chunks)
    w_last, w_again = int(w_head) + (depths if w_head else 0), w_blocks if layout.recompute == "full" else 0
    calls: list[Call] = []
    if layout.sequence_parallel:
        w_gather, w_scatter = 4 * w_blocks + w_last + 2 * w_again, 2 * w_blocks + w_last + w_again
        calls += [("tp", "all_gather", full, act)] * (6 * blocks + 2 * again + first + 2 * last + w_gather)
        calls += [("tp", "reduce_scatter", full, act)] * (4 * blocks + again + first + last + w_scatter)
        calls += [("tp", "all_reduce", model.d_model, act)] * (2 * blocks + last + 2 * depths)
        calls += [("tp", "all_reduce", 2 * model.d_model ** 2, act)] * depths
        calls = sequence_parallel_moe(model, layout, calls, moe=_moe_layers(model, layout, stage, pp_split),
                                      full=full, act=act, w_moe=w_moe)
    else:
        whole = _whole_chunk_w(model, layout, stage, pp_split)
        # a MoE layer is replicated over tp (its MLP's two all-reduces gone); cut over tp (expert_tp) its experts'
        # outputs, and their inputs' gradients, are summed over tp as rows [tokens x top_k, d]
        moe = _moe_layers(model, layout, stage, pp_split)
        w_reduce = 2 * w_blocks - w_moe + w_last + w_again if whole else 0
        calls += [("tp", "all_reduce", full, act)] * (4 * blocks - 2 * moe + again + first + last + w_reduce)
        if layout.expert_tp:
            calls += [("tp", "all_reduce", full * model.top_k, act)] * (moe * (2 + (layout.recompute == "full")))
    calls += [("tp", "all_reduce", tokens, 4)] * (3 * last)
    return calls


def step_calls(model: ModelConfig, layout: Layout, *, stage: int, precision: str = "fp32", bucket_mb: float = 25.0,
               pp_split: tuple[int, ...] = (), grad_bytes: int = 4) -> list[Call]:
    """The collectives of a step that are not per micro-batch and not dp's gradient and parameter
    traffic: the tied embedding's gradient and the scalars (loss totals, gradient-norm sums)."""
    calls: list[Call] = []
    _, first, last = _held(model, layout, stage, pp_split)
    # one end of the tie (the MTP depths' copy too) on this rank; both (a V schedule's rank 0) tie locally
    if (model.tie_embeddings or model.mtp_depth) and layout.pp > 1 and first != last:
        params = [p for p in rank_params(model, layout.dims, stage, pp_split, expert_tp=layout.expert_tp,
                                         pipeline=layout.pipeline) if p.tied]
        if layout.zero:
            (group,) = [g for g in flat_groups(params, zero=layout.zero, shards=layout.shards,
                                               bucket_bytes=int(bucket_mb * 2**20))]
            calls.append(("tied", "all_reduce", group.shard_numel, grad_bytes))
        else:
            calls.append(("tied", "all_reduce", params[0].numel, 4))
    # tp slices and replicated weights sum over different axes; a grid's matrices, the replicated kind (none of its
    # parameters) and its vectors' blocks along each activation layout's width over three or four
    parts = norm_parts(layout)
    if layout.dims.replicas > 1:
        calls.append((layout.dims.data_axis, "all_reduce", 2, 8))
        if layout.zero:  # the norm's squares add up over the ranks that hold different shards
            shard_axis = "dp_shard" if layout.shard_group not in (None, layout.dp) else layout.dims.data_axis
            calls += [(shard_axis, "all_reduce", 1, 4)] * parts
    if model.n_experts:  # routing statistics (paratrain.hybrid.experts.routing_totals) and the experts' norm part
        calls += expert_step_calls(model, layout, moe=_moe_layers(model, layout, stage, pp_split))
    if layout.tp > 1:
        calls.append(("tp", "all_reduce", 1, 4))
        # a grid's vectors' blocks, along the row (3d: the output, then the input axis)
        calls += [(axis, "all_reduce", 1, 4) for axis in width_axes(layout)]
    if layout.pp > 1:
        calls.append(("pp", "all_reduce", 2, 8))
        calls += [("pp", "all_reduce", 1, 4)] * parts
    return calls


def pipeline_sends(model: ModelConfig, layout: Layout, *, stage: int, micro_batches: int, precision: str = "fp32",
                   pp_split: tuple[int, ...] = ()) -> int:
    """Bytes pipeline rank `stage` sends in one step: activations forward, their gradients backward."""
    if layout.pp == 1:
        return 0
    chunks, placed = layout.pp * layout.virtual_stages, layout.pipeline.rank_of if layout.pipeline else (lambda c: c)
    mine = layout.chunks_of(stage)  # (a V schedule's turn hands chunk p - 1's output to chunk p on its own rank)
    messages = sum((c < chunks - 1 and placed(c + 1) != stage) + (c > 0 and placed(c - 1) != stage)
                   for c in mine) * micro_batches
    split = (layout.tp if layout.sequence_parallel else 1) * layout.dims.sequence_parts
    rows, width = grid_cuts(layout)[:2]  # a grid's block of the activation (1d: the whole of it)
    message = (layout.micro_batch // rows * (model.seq_len // split) * (model.d_model // width)
               * _activation_bytes(layout, precision))
    return messages * message



def _whole_chunk_w(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...]) -> bool:
    """Whether zero bubble's W walks the whole chunk again on pipeline rank `stage` rather than module by module
    (paratrain.pipeline.runtime): under recompute, where two modules share a parameter (the tied head and the MTP
    depths' embedding), or where a MoE layer runs (its router returns no single tensor)."""
    _, first, last = _held(model, layout, stage, pp_split)
    ends = model.tie_embeddings or model.mtp_depth  # the embedding's copies: the tied head's, the MTP depths'
    shared = bool(last and ((model.mtp_depth and model.tie_embeddings) or (first and ends)))
    return layout.recompute != "none" or shared or _moe_layers(model, layout, stage, pp_split) > 0


def _moe_layers(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...]) -> int:
    """The MoE layers pipeline rank `stage` holds."""
    return sum(model.is_moe(i - 1) for i in _layers(model, layout, stage, pp_split) if 1 <= i <= model.n_layer)


def _layers(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...]) -> set[int]:
    """The GPT layers (0: the embedding, i: block i - 1, L + 1: the head) pipeline rank `stage` holds."""
    ranges = chunk_layers(model, layout.dims, pp_split)
    return {i for c in layout.chunks_of(stage) for i in range(*ranges[c])}


def _held(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...]) -> tuple[int, bool, bool]:
    """(blocks it runs, the MTP depths' with the head; holds the embedding; holds the final norm and head) on pipeline
    rank `stage`."""
    ranges = chunk_layers(model, layout.dims, pp_split)
    mine = layout.chunks_of(stage)
    layers = {i for c in mine for i in range(*ranges[c])}
    last = model.n_layer + 1 in layers
    return len(layers & set(range(1, model.n_layer + 1))) + (model.mtp_depth if last else 0), 0 in layers, last


def _w_repeats(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...],
               chunks: tuple[int, ...] | None = None) -> tuple[int, bool, int]:
    """(blocks, the MTP depths' with the head; whether the head; MoE layers) on pipeline rank `stage` whose zero-bubble
    W runs after an I that did something: their backward's traffic runs again. Chunk 0's I has no input gradient to
    take (the token ids), so its W is the whole backward; none without a split backward. chunks: only these of the
    rank's (None: all)."""
    if layout.pipeline is None or not layout.pipeline.splits_backward:
        return 0, False, 0
    ranges = chunk_layers(model, layout.dims, pp_split)
    layers = {i for c in layout.chunks_of(stage) if c > 0 and (chunks is None or c in chunks)
              for i in range(*ranges[c])}
    head = model.n_layer + 1 in layers
    blocks = layers & set(range(1, model.n_layer + 1))
    return len(blocks) + (model.mtp_depth if head else 0), head, sum(model.is_moe(i - 1) for i in blocks)


def w_counts(layout: Layout, stage: int, micro_batches: int) -> dict[int, int]:
    """{chunk: its W passes in a step} for the chunks of pipeline rank `stage` whose W repeats the backward's traffic
    (chunk > 0, a split backward): every micro-batch's under ZB-H1 and ZB-V, only those DualPipeV splits (its other
    backward passes run whole, as B)."""
    if layout.pipeline is None or not layout.pipeline.splits_backward:
        return {}
    counts = Counter(a.chunk for a in layout.pipeline.order(stage, micro_batches) if a.kind == "W" and a.chunk > 0)
    return dict(sorted(counts.items()))


def _activation_bytes(layout: Layout, precision: str) -> int:
    """The residual stream's element: 16 bits when ZeRO stores the parameters so, else float32."""
    return BYTES[precision] if layout.zero else 4
