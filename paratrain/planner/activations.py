"""Bytes one rank keeps for backward: the reference GPT's saved activations, as paratrain runs it.

What autograd keeps for backward, per micro-batch, for the reference GPT as paratrain runs it
(counted as paratrain.memory.saved_activations counts: each storage once, parameters left out).
Derived from the model's code op by op and checked to the byte on one process and under tp / SP
(tests/unit/test_planner_memory.py, tests/distributed/test_planner.py). Three storage modes:
  fp32      everything float32;
  autocast  16-bit matmuls over float32 weights (zero 0 with bf16 / fp16): the residual stream and
            norms stay float32, each linear keeps a 16-bit copy of its input and of its weight;
  low       parameters stored in 16 bits (ZeRO with bf16 / fp16; buffers stay float32): the residual
            stream is 16-bit; each norm keeps its 16-bit input and recomputes its float32 copy in backward.
tokens n = micro_batch x seq / cp; t = tp; q = t with sequence parallelism (norms and residuals hold
n / t tokens), else 1. The grid modes (2d, 2.5d, 3d) cut every tensor into blocks of rows and width, rows x width =
tp (grid_cuts): the same terms at n / rows tokens of d / width, heads h / width; each linear keeps its own 16-bit
weight block under autocast, per micro-batch.

Context parallelism (cp ranks each holding seq / cp tokens of every sequence, paratrain.context_parallel)
changes three things, checked to the byte like the rest (tests/distributed/test_planner.py):
  rotary    each attention indexes the tables at its tokens' positions (a copy, [seq / cp, hd / 2]): in
            float32 the rotation keeps each block's copies of cos and sin, not the tables once;
  ring      the ring's own backward keeps q, k, v, out and the float32 log-sum-exp as SDPA does, and the
            positions of this rank's tokens once;
  Ulysses   the all-to-all keeps nothing, so neither the rotated q and k nor the qkv output are kept by
            attention: SDPA keeps its head-sharded q, k, v and output ([B, h / cp, seq, hd], as many
            elements as this rank's heads of its tokens) and float32 log-sum-exp, and the two int64
            orders that sort the gathered sequence by position and back ([seq] each);
  and the token ids are a copy of this rank's positions of the batch (not a view of its windows).
Selective recompute keeps the attention core's inputs only, whatever cp does inside it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from paratrain.config.model import ModelConfig
from paratrain.memory import precision_policy
from paratrain.pipeline.schedules import Action, Schedule
import paratrain.planner.cp_cost as cp_cost
from paratrain.planner.grid import grid_cuts
from paratrain.planner.layout import Layout, chunk_layers, layer_ranges
from paratrain.planner.moe_cost import layer_activation_bytes
from paratrain.planner.mtp_activations import mtp_activation_bytes, mtp_proj_cast
from paratrain.topology.dims import ParallelDims


def storage_mode(precision: str, zero: int) -> str:
    """How activations are kept under a precision policy: 'fp32', 'autocast' (16-bit matmul outputs over float32
    weights) or 'low' (ZeRO's 16-bit parameters: every activation 16-bit)."""
    if not precision_policy(precision).low:
        return "fp32"
    return "low" if zero >= 1 else "autocast"


def _norm_and_column_input(tokens: float, d: int, mode: str) -> float:
    """An RMSNorm and the input the next (column) linear keeps: the norm's input in its own dtype and 1/rms in
    float32 (paratrain.nn.norms recomputes the rest), and x * weight (under autocast the linear's 16-bit
    copy of it)."""
    if mode == "fp32":
        return tokens * (2 * d * 4 + 4)
    if mode == "autocast":
        return tokens * (d * 4 + 4 + d * 2)
    return tokens * (d * 2 + 4 + d * 2)  # low: the 16-bit input, 1/rms, the 16-bit x * weight


def block_activation_bytes(model: ModelConfig, layout: Layout, *, seq: int, mode: str = "fp32",
                           moe: bool = False, moe_imbalance: float = 1.0) -> float:
    """Bytes one transformer block keeps for backward, per micro-batch of `layout` (its micro-batch, tp,
    sequence parallelism, cp, recomputation and ep are what count; rope tables excluded: they are one storage
    for the whole model, see rope_bytes); seq: tokens of a whole sequence; moe: a block with a MoE layer
    for its MLP (moe_imbalance: StepSettings')."""
    b, s, d, f, h, t = layout.micro_batch, layout.local_tokens(seq), model.d_model, model.ff_dim, model.n_head, layout.tp
    sequence_parallel, recompute = layout.sequence_parallel, layout.recompute
    n = b * s
    q = t if sequence_parallel else 1
    res = 2 if mode == "low" else 4
    # the norms' rows and width on this rank (sequence parallelism: n / tp tokens; a grid: n / rows tokens of
    # d / width). A grid cuts every other tensor into rows x width = tp blocks too: its attention and MLP terms
    # below (n d / t, n f / t elements a tensor) hold as they are; its heads per rank are h / width.
    rows, width, _ = grid_cuts(layout)
    tokens, wide = (n / q, d) if not layout.dims.tp_grid else (n / rows, d // width)
    heads, lse_rows = (h // t, b) if not layout.dims.tp_grid else (h // width, b / rows)
    if recompute == "full":
        return tokens * wide * res  # the block's input
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {recompute!r}")
    act = 4 if mode == "fp32" else 2
    norms = _norm_and_column_input(tokens, wide, mode)
    # qkv output (3), rotated q and k (2), attention output (1), and its [B, S, D] copy that `out` keeps
    # (1; a view, not a copy, when a rank holds one head), + the softmax's log-sum-exp in float32.
    # Selective recompute keeps the core's inputs (q, k, v: counted) and drops what the fused kernel
    # saved: its log-sum-exp, and its output unless `out` keeps that very storage (one head).
    copy = 0 if heads == 1 or s == 1 else 1
    if recompute == "selective":
        attention = 6 * n * d / t * act
    else:  # SDPA's or cp's attention's own backward: its [n, d / tp] tensors, float32 log-sum-exp (cp_cost)
        kept, extra = cp_cost.saved_attention(layout, seq=seq)
        attention = (kept + copy) * n * d / t * act + lse_rows * heads * s * 4 + extra
    attention += cp_cost.rotation_bytes(model, layout, local=s, mode=mode)
    if moe:  # the MoE layer keeps its own copies of the normed input (moe_activation_bytes)
        norms += _norm_and_column_input(n / q, d, mode) - n / q * d * (4 if mode == "fp32" else 2)
        mlp = layer_activation_bytes(model, layout, micro_batch=b, seq=s // q, mode=mode, imbalance=moe_imbalance)
    else:
        norms += _norm_and_column_input(tokens, wide, mode)
        mlp = 2 * n * f / t * act  # up's output (GELU's input) and GELU's output (down's input)
    casts = 0.0
    if mode != "fp32":  # each apply_rope keeps 16-bit copies of the float32 cos and sin tables
        casts += 4 * s * (model.head_dim // 2) * 2
    return norms + attention + mlp + casts + block_weight_casts(model, layout, mode=mode, moe=moe)


def block_weight_casts(model: ModelConfig, layout: Layout, *, mode: str, moe: bool = False) -> float:
    """The 16-bit copies of a block's linear weights autocast keeps (zero 0 with bf16 / fp16; nothing else): under
    sequence parallelism the column layers (qkv, up) cast inside their own autograd function and keep the float32
    weight, so only the row layers' (out, down) copies are kept; a MoE layer counts its own (moe_activation_bytes).
    Under pp one copy per stage for the whole step, whatever the micro-batches in flight (paratrain.memory.
    precision.casts_once); without pp one per micro-batch, released by its backward."""
    if mode != "autocast":
        return 0.0
    d, f, t = model.d_model, model.ff_dim, layout.tp
    if layout.dims.tp_grid:  # every grid linear casts its own block inside its autograd function and keeps it
        return 2 * (4 * d * d + 2 * d * f) / grid_cuts(layout)[2]
    mlp_weights = 0 if moe else d * f
    column = 0 if layout.sequence_parallel else 3 * d * d + mlp_weights
    return 2 * (column + d * d + mlp_weights) / t


def head_weight_cast(model: ModelConfig, *, tp: int, sequence_parallel: bool, mode: str) -> float:
    """The head's 16-bit weight copy under autocast (see block_weight_casts; tp: the blocks its weight is cut into)."""
    return model.padded_vocab // tp * model.d_model * 2 if mode == "autocast" and not sequence_parallel else 0.0


def rope_bytes(model: ModelConfig, *, seq: int, mode: str, recompute: str = "none", indexed: bool = False) -> float:
    """The rotary tables (cos, sin: [model.seq_len, head_dim / 2], float32 buffers: ZeRO stores only
    parameters in 16 bits: every block reads its rows of the whole tables), kept once for the whole
    model: by the rotations in float32, or as inputs of recomputed blocks. In 16-bit compute the
    rotations keep 16-bit copies per block instead, and (indexed: a sequence split over ranks) copies of the rows
    at the rank's positions (both counted in the block)."""
    if recompute != "full" and (mode != "fp32" or indexed):
        return 0.0
    return 2 * model.seq_len * (model.head_dim // 2) * 4


def embedding_activation_bytes(*, micro_batch: int, seq: int, tp: int = 1, sequence_parts: int = 1,
                               share: int = 1) -> float:
    """The embedding keeps the token ids (int64; the batch holds one more column of targets; a sequence split over
    sequence_parts ranks a copy of this rank's seq / parts positions); split over tp, each rank keeps its local ids
    and the mask of ids outside its vocabulary slice (a grid looks every row of the micro-batch up, 2.5d its grid's
    share: 1 / share of them)."""
    n = micro_batch * seq // sequence_parts // share
    if tp > 1:
        return n * 9
    return n * 8 if sequence_parts > 1 else micro_batch * (seq + 1) * 8


def head_activation_bytes(model: ModelConfig, *, micro_batch: int, seq: int, tp: int = 1,
                          sequence_parallel: bool = False, mode: str = "fp32",
                          grid: tuple[int, int, int] | None = None) -> float:
    """The final norm, the head's input (and 16-bit weight copy under autocast), and the loss, which
    keeps the logits in their own dtype and O(n) per-row values (paratrain.nn.loss; under tp the
    vocabulary-parallel loss likewise for this rank's slice): never a float32 copy of the logits.
    grid: a grid mode's (row, width, weight) blocks (grid_cuts): the logits a block of rows and vocabulary."""
    b, s, d, t = micro_batch, seq, model.d_model, tp
    n = b * s
    if grid is not None:
        rows, width, blocks = grid
        logit_bytes = 4 if mode == "fp32" else 2
        return (_norm_and_column_input(n / rows, d // width, mode)
                + head_weight_cast(model, tp=blocks, sequence_parallel=False, mode=mode)
                + n / rows * (model.padded_vocab // width * logit_bytes + 18))
    q = t if sequence_parallel else 1
    total = _norm_and_column_input(n / q, d, mode) + head_weight_cast(model, tp=t, sequence_parallel=sequence_parallel,
                                                                    mode=mode)
    logit_bytes = 4 if mode == "fp32" else 2  # the chunked losses keep the logits themselves, in the head's dtype
    if t == 1:  # logits [n, Vp], targets int64, the ignore mask, float32 log-sum-exp
        total += n * model.padded_vocab * logit_bytes + n * 13
    else:  # logits [n, Vp / t], row maxima and sums of exponentials (float32), local targets, two masks
        total += n * model.padded_vocab // t * logit_bytes + n * 18
    return total


def chunk_activation_bytes(model: ModelConfig, layout: Layout, *, seq: int, mode: str,
                           pp_split: tuple[int, ...] = (), moe_imbalance: float = 1.0) -> list[float]:
    """Bytes one micro-batch leaves saved in each pipeline chunk (its layers' terms)."""
    # cached on what they depend on (the search asks for many ZeRO stages, schedules and pipeline ranks at once)
    return list(_chunk_sizes(model, layout.saved_fields, moe_imbalance, seq, mode, pp_split))


@functools.lru_cache(maxsize=8192)
def _chunk_sizes(model: ModelConfig, saved: tuple[Any, ...], moe_imbalance: float, seq: int, mode: str,
                 pp_split: tuple[int, ...]) -> tuple[float, ...]:
    layout = Layout.of_saved(saved)
    block = block_activation_bytes(model, layout, seq=seq, mode=mode)
    moe_block = block_activation_bytes(model, layout, seq=seq, mode=mode, moe=True, moe_imbalance=moe_imbalance)
    kwargs = dict(micro_batch=layout.micro_batch, seq=layout.local_tokens(seq), tp=layout.tp)
    grid = grid_cuts(layout) if layout.dims.tp_grid else None
    head = head_activation_bytes(model, sequence_parallel=layout.sequence_parallel, mode=mode, grid=grid, **kwargs)
    head += mtp_activation_bytes(model, layout, seq=seq, mode=mode, block=block, head=head, head_cast=head_weight_cast(
        model, tp=layout.tp, sequence_parallel=layout.sequence_parallel, mode=mode))
    embedding = embedding_activation_bytes(micro_batch=layout.micro_batch, seq=seq, tp=layout.tp,
                                           sequence_parts=layout.dims.sequence_parts,
                                           share=layout.tp_depth)  # (a 2.5d stack's depth; 1 in every other mode)
    sizes = []
    for blocks, moe, first, last in _chunk_blocks(model, layout.dims.pp * layout.dims.virtual_stages, pp_split):
        ends = (embedding if first else 0.0) + (head if last else 0.0)
        sizes.append((blocks - moe) * block + moe * moe_block + ends)
    return tuple(sizes)


@functools.lru_cache(maxsize=1024)
def _chunk_blocks(model: ModelConfig, parts: int, pp_split: tuple[int, ...]) -> tuple[tuple[int, int, bool, bool], ...]:
    """(blocks, of them MoE blocks, holds the embedding, holds the head) of each of the `parts` pipeline chunks, as
    the engine cuts the layers (cached on the cut: every layout of a pp x v shares it)."""
    out = []
    for start, end in layer_ranges(model, parts, pp_split):
        held = range(max(start, 1), min(end, model.n_layer + 1))  # GPT layer i + 1 is block i
        out.append((len(held), _moe_blocks(model, held), start == 0, end == model.n_layer + 2))
    return tuple(out)


def _moe_blocks(model: ModelConfig, layers: range) -> int:
    """How many of these GPT layers (layer i + 1 is block i) are MoE blocks."""
    before = _moe_before(model)
    return before[layers.stop - 1] - before[layers.start - 1] if len(layers) else 0


@functools.lru_cache(maxsize=64)
def _moe_before(model: ModelConfig) -> tuple[int, ...]:
    """[i]: the MoE blocks among GPT layers 1 .. i."""
    counts = [0]
    for block in range(model.n_layer):
        counts.append(counts[-1] + model.is_moe(block))
    return tuple(counts)


def activation_bytes(model: ModelConfig, layout: Layout, *, seq: int, mode: str, stage: int = 0,
                     microbatches: int = 1, pp_split: tuple[int, ...] = (), moe_imbalance: float = 1.0) -> float:
    """Peak bytes of saved activations on pipeline rank `stage` over a step (seq: tokens of a whole
    sequence, of which each cp rank holds seq / cp): one micro-batch at a time
    without pp (accumulation runs each backward before the next forward); under pp, the schedule's
    own program walked action by action (F saves a chunk's activations, B or W releases them)."""
    sizes = chunk_activation_bytes(model, layout, seq=seq, mode=mode, pp_split=pp_split, moe_imbalance=moe_imbalance)
    ranges = chunk_layers(model, layout.dims, pp_split)
    mine = layout.chunks_of(stage)
    has_block = any(max(ranges[c][0], 1) < min(ranges[c][1], model.n_layer + 1) for c in mine)
    rope = (rope_bytes(model, seq=seq, mode=mode, recompute=layout.recompute,
                       indexed=layout.dims.sequence_parts > 1) + cp_cost.positions_bytes(layout, seq=seq)
            ) if has_block else 0.0
    if layout.pp == 1:
        return sizes[0] + rope
    casts = _chunk_casts(model, layout, mode, pp_split)
    assert layout.pipeline is not None
    return _peak_in_flight(layout.pipeline, microbatches, stage, sizes, casts) + rope


def _peak_in_flight(schedule: Schedule, microbatches: int, stage: int, sizes: Sequence[float],
                    casts: Sequence[float]) -> float:
    """The most bytes a stage's schedule keeps saved at once: F saves a chunk's micro-batch (its size less its
    weight casts), B or W releases it; a chunk's weight casts (one copy for the step) from its first F to the
    release of its last micro-batch. sizes, casts: every chunk of the model's (the stage reads its own)."""
    microbatches = schedule.peak_microbatches(microbatches)
    mine = _in_flight_counts(schedule, microbatches, stage)[0]
    own = [sizes[c] - casts[c] for c in mine]
    own_casts = [casts[c] for c in mine]
    signs = tuple((w > 0) - (w < 0) for w in (*own, *own_casts))
    peak = 0.0
    for saved, held in _peak_states(schedule, microbatches, stage, signs):
        live = 0.0
        for n, size in zip(saved, own):
            live += n * size
        kept = 0.0
        for n, cast in zip(held, own_casts):
            kept += n * cast
        peak = max(peak, live + kept)
    return peak


@functools.lru_cache(maxsize=4096)
def _peak_states(schedule: Schedule, microbatches: int, stage: int,
                 signs: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """_in_flight_counts' states that can hold the peak for bytes of these signs (each chunk's size less its casts,
    then each one's casts: 1, 0 or -1): those no other state holds at least as much as on every chunk (a state
    dominated so holds no more bytes, to the last bit: each product and sum rounds monotonically)."""
    states = _in_flight_counts(schedule, microbatches, stage)[1]
    signed = {tuple(w * n for w, n in zip(signs, (*saved, *held))): (saved, held) for saved, held in states}
    kept: list[tuple[int, ...]] = []  # largest sum first: a state can be dominated only by one of no smaller sum
    for vector in sorted(signed, key=sum, reverse=True):
        if not any(all(a <= b for a, b in zip(vector, other)) for other in kept):
            kept.append(vector)
    return tuple(signed[vector] for vector in kept)


@functools.lru_cache(maxsize=1024)
def _in_flight_counts(schedule: Schedule, microbatches: int,
                      stage: int) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]:
    """(the stage's chunks, and the distinct states after each forward of its program, where the peaks are: how many
    micro-batches of each of those chunks hold saved activations, and whether each one's weight casts are held)."""
    mine = tuple(schedule.chunks_of(stage))
    at = {chunk: i for i, chunk in enumerate(mine)}
    saved_now, held_now = [0] * len(mine), [0] * len(mine)
    states: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for action in _compute_program(schedule, microbatches, stage):
        i = at[action.chunk]
        if action.kind == "F":
            saved_now[i] += 1
            held_now[i] = 1
            states.setdefault((tuple(saved_now), tuple(held_now)))
        elif action.kind in ("B", "W"):
            saved_now[i] -= 1
            if action.mb == microbatches - 1:  # its last micro-batch released: no forward reuses the casts
                held_now[i] = 0
    return mine, tuple(states)


def _chunk_casts(model: ModelConfig, layout: Layout, mode: str, pp_split: tuple[int, ...]) -> tuple[float, ...]:
    """Each pipeline chunk's weight casts under autocast: its dense blocks' and the head's (one copy per step). A
    grid's linears cast their blocks inside their own autograd functions, once per micro-batch: none held once."""
    return _casts(model, layout.dims, layout.sequence_parallel, mode, pp_split)


@functools.lru_cache(maxsize=8192)
def _casts(model: ModelConfig, dims: ParallelDims, sequence_parallel: bool, mode: str,
           pp_split: tuple[int, ...]) -> tuple[float, ...]:
    layout = Layout(dims=replace(dims, dp_replicate=dims.dp, dp_shard=1), sequence_parallel=sequence_parallel)
    if layout.dims.tp_grid:
        return tuple(0.0 for _ in chunk_layers(model, layout.dims, pp_split))
    block = block_weight_casts(model, layout, mode=mode)
    head = head_weight_cast(model, tp=layout.tp, sequence_parallel=layout.sequence_parallel, mode=mode)
    casts = []
    for start, end in chunk_layers(model, layout.dims, pp_split):
        held = range(max(start, 1), min(end, model.n_layer + 1))
        dense = len(held) - _moe_blocks(model, held)
        last = head + model.mtp_depth * (block + mtp_proj_cast(model, mode))  # the head and the MTP depths
        casts.append(dense * block + (last if end == model.n_layer + 2 else 0.0))
    return tuple(casts)


@functools.lru_cache(maxsize=1024)
def _compute_program(schedule: Schedule, microbatches: int, stage: int) -> tuple[Action, ...]:
    return tuple(schedule.order(stage, microbatches))
