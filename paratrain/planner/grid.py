"""The grid modes' tensor-parallel traffic and time (2d, 2.5d, 3d: paratrain.tensor_parallel.grid, .summa, .cube),
per micro-batch on a pipeline stage, exactly as the engine issues it (checked by `paratrain plan --dry-run`:
tests/unit/test_dryrun.py). T: the micro-batch's tokens (micro_batch x seq), q the grid side, d the depth; a
linear W[out, in]; elements in the activations' dtype unless said.

    2d / 2.5d, per linear (each grid on its T / d tokens, r = T / (d q) rows a rank)
        forward    q broadcasts of W[out/q, in/q] down the column, q reduces of Y[r, out/q] along the row
        backward   q broadcasts of dY[r, out/q] along the row, q of W down the column, q reduces of dW down
                   the column; 2.5d: dW all-reduced over depth
        norm       forward and backward an all-reduce of [r] (float32 at least) along the row; its weight's
                   gradient [d_model / q] all-reduced down the column (and over depth)
        embedding  a reduce-scatter down the column of [T / d, d_model / q] (backward: the all-gather); 2.5d: its
                   gradient [V / q, d_model / q] all-reduced over depth
        loss       3 all-reduces of [r] (float32 at least) along the row; the loss summed down the column (and over
                   depth): a scalar each
    3d, per linear (r = T / q^2 rows a rank; a column layer gathers over input and scatters over output, a row
        layer the other way round)
        forward    all-gather of X[r q, in/q] over G, of W[out/q, in/q] over the weight axis, reduce-scatter of
                   [r q, out/q] over R
        backward   all-gather of dY over R, X over G and W over the weight axis again; reduce-scatters of
                   dX[r q, in/q] over G and dW[out/q, in/q] over the weight axis
        norm, loss as 2d on the stream's rows (width: output axis) and the logits' (width: input axis; the loss
                   summed over output and weight)
        embedding  reduce-scatters of [T, d_model / q] over the weight axis, then of [T / q, d_model / q] over
                   the input axis (backward: the all-gathers)

Full recompute runs each block's forward again in backward, its traffic included: a grid linear's autograd
function saves its tensors when it returns, so torch's checkpoint cannot stop inside the block's last one.
"""

from __future__ import annotations

import functools

from paratrain.config.model import ModelConfig
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout

Call = tuple[str, str, int, int]


def grid_cuts(layout: Layout) -> tuple[int, int, int]:
    """(row blocks, width blocks, weight blocks) of a grid mode: how its activations' rows and width and its
    matrices are cut (1d: (1, 1, tp) for the matrices; its activations are whole or split by tp alone)."""
    mode, q = layout.tp_mode, layout.dims.grid_side
    if mode == "1d":
        return 1, 1, layout.tp
    if mode == "3d":
        return q * q, q, q ** 3
    return layout.tp_depth * q, q, q * q  # 2d; 2.5d: every grid of the stack holds the same blocks


def width_axes(layout: Layout) -> tuple[str, ...]:
    """The sub-axes a grid's vectors' blocks lie along (the activation's width: 2d / 2.5d the row, 3d the output
    and the input axis), each a norm's squares are summed over; none under 1d."""
    if layout.tp_mode == "1d":
        return ()
    return ("tp_output", "tp_input") if layout.tp_mode == "3d" else ("tp_row",)


def norm_parts(layout: Layout) -> int:
    """The gradient norm's kinds of parts a rank sums (each one all-reduce over a shard group, and over pp): tp's
    slices and its replicated weights (1d: 2), a grid's matrices, the replicated kind and its vectors' blocks along
    each width axis (2d / 2.5d: 3, 3d: 4); 1 without tp."""
    return 2 + len(width_axes(layout)) if layout.tp > 1 else 1


def _linears(model: ModelConfig) -> list[tuple[int, int, str]]:
    """(out, in, style) of a GPT block's linears, in forward order."""
    d, f = model.d_model, model.ff_dim
    return [(3 * d, d, "column"), (d, d, "row"), (f, d, "column"), (d, f, "row")]


def _linear_calls(layout: Layout, out: int, inp: int, style: str, tokens: int, act: int, *,
                  forward_only: bool = False) -> list[Call]:
    q, mode = layout.dims.grid_side, layout.tp_mode
    calls: list[Call] = []
    if mode == "3d":
        rows = tokens // (q * q) * q  # the rows a linear gathers: r q
        g, r = ("tp_input", "tp_output") if style == "column" else ("tp_output", "tp_input")
        w = out // q * inp // q
        calls += [(g, "all_gather", rows * inp // q, act), ("tp_weight", "all_gather", w, act),
                  (r, "reduce_scatter", rows * out // q, act)]
        if not forward_only:
            calls += [(r, "all_gather", rows * out // q, act), (g, "all_gather", rows * inp // q, act),
                      ("tp_weight", "all_gather", w, act), (g, "reduce_scatter", rows * inp // q, act),
                      ("tp_weight", "reduce_scatter", w, act)]
        return calls
    rows = tokens // (layout.tp_depth * q)
    w, y = out // q * inp // q, rows * out // q
    calls += [("tp_col", "broadcast", w, act)] * q + [("tp_row", "reduce", y, act)] * q
    if not forward_only:
        calls += ([("tp_row", "broadcast", y, act)] * q + [("tp_col", "broadcast", w, act)] * q
                  + [("tp_col", "reduce", w, act)] * q)
        if layout.tp_depth > 1:
            calls.append(("tp_depth", "all_reduce", w, act))
    return calls


def _axes(layout: Layout, *, turned: bool = False) -> tuple[str, tuple[str, ...]]:
    """(width axis, rows' axes) of an activation's layout, as paratrain.tensor_parallel's Grid.stream and Cube.stream /
    Cube.turned name them: the axis a norm's or the loss's sums run along, and the ones a vector's copies span."""
    if layout.tp_mode == "3d":
        return ("tp_input", ("tp_output", "tp_weight")) if turned else ("tp_output", ("tp_input", "tp_weight"))
    return "tp_row", ("tp_col",) + (("tp_depth",) if layout.tp_depth > 1 else ())


def _norm_calls(layout: Layout, rows: int, d: int, act: int, *, forward_only: bool = False) -> list[Call]:
    width, copies = _axes(layout)
    calls: list[Call] = [(width, "all_reduce", rows, max(act, 4))]
    if not forward_only:
        calls.append((width, "all_reduce", rows, max(act, 4)))
        calls += [(axis, "all_reduce", d, act) for axis in reversed(copies)]
    return calls


def grid_calls(model: ModelConfig, layout: Layout, *, blocks: int, first: bool, last: bool,
               act: int, seq: int | None = None) -> list[Call]:
    """The tp collectives of one micro-batch on a stage holding `blocks` blocks, the embedding (first) and the
    final norm, head and loss (last); seq: a sequence's tokens (default the model's)."""
    q, d, v = layout.dims.grid_side, model.d_model, model.padded_vocab
    tokens = layout.micro_batch * (seq or model.seq_len)
    rows = tokens // (q * q) if layout.tp_mode == "3d" else tokens // (layout.tp_depth * q)
    block: list[Call] = []
    # full recompute runs the block's forward again (a linear's autograd function saves on return)
    for forward_only in (False, True) if layout.recompute == "full" else (False,):
        for index, (out, inp, style) in enumerate(_linears(model)):
            if index in (0, 2):  # the attention's and the MLP's norms
                block += _norm_calls(layout, rows, d // q, act, forward_only=forward_only)
            block += _linear_calls(layout, out, inp, style, tokens, act, forward_only=forward_only)
    calls = block * blocks
    if first:
        if layout.tp_mode == "3d":
            calls += [("tp_weight", "reduce_scatter", tokens * d // q, act),
                      ("tp_input", "reduce_scatter", tokens // q * d // q, act),
                      ("tp_input", "all_gather", tokens // q * d // q, act),
                      ("tp_weight", "all_gather", tokens * d // q, act)]
        else:
            calls += [("tp_col", op, tokens // layout.tp_depth * d // q, act) for op in ("reduce_scatter", "all_gather")]
            if layout.tp_depth > 1:
                calls.append(("tp_depth", "all_reduce", v // q * d // q, act))
    if last:
        calls += _norm_calls(layout, rows, d // q, act) + _linear_calls(layout, v, d, "column", tokens, act)
        vocab, sums = _axes(layout, turned=True)  # the logits of a column head
        calls += [(vocab, "all_reduce", rows, 4)] * 3 + [(axis, "all_reduce", 1, 4) for axis in sums]
    return calls


def _spans(layout: Layout) -> dict[str, int]:
    """How many consecutive ranks each grid sub-axis's group spans (tp_index = ... row q + column; 3d: a q^2 + b q +
    c; 2.5d's depth: the whole tp group)."""
    q = layout.dims.grid_side
    return {"tp_row": q, "tp_output": q, "tp_col": q * q, "tp_weight": q * q, "tp_input": q ** 3,
            "tp_depth": layout.tp}


def grid_time(model: ModelConfig, layout: Layout, hw: Hardware, *, blocks: int, last: bool, act: int,
              seq: int) -> float:
    """Seconds one micro-batch's grid collectives take on a stage (on the critical path, as 1d's): each call over
    the links its group spans; a broadcast or reduce of n bytes takes n / bw (pipelined), an all-gather or
    reduce-scatter (k - 1) / k of its full tensor, an all-reduce twice that."""
    grid = Layout.of(tp=layout.tp, tp_mode=layout.tp_mode, tp_depth=layout.tp_depth, micro_batch=layout.micro_batch,
                     recompute=layout.recompute)  # what the calls read: cached on it
    return _grid_time(model, grid, hw, blocks, last, act, seq)


@functools.lru_cache(maxsize=8192)
def _grid_time(model: ModelConfig, layout: Layout, hw: Hardware, blocks: int, last: bool, act: int, seq: int) -> float:
    spans, q, depth = _spans(layout), layout.dims.grid_side, layout.tp_depth

    def seconds(calls: list[Call]) -> float:
        total = 0.0
        for axis, op, numel, size in calls:
            ranks = depth if axis == "tp_depth" else q
            bw = hw.intra_node_bw if spans[axis] <= hw.devices_per_node else hw.inter_node_bw
            factor = {"broadcast": ranks / (ranks - 1), "reduce": ranks / (ranks - 1), "all_reduce": 2.0}.get(op, 1.0)
            total += hw.latency_s + factor * (ranks - 1) / ranks * numel * size / bw
        return total

    block = seconds(grid_calls(model, layout, blocks=1, first=False, last=False, act=act, seq=seq))
    ends = seconds(grid_calls(model, layout, blocks=0, first=False, last=True, act=act, seq=seq)) if last else 0.0
    return blocks * block + ends
