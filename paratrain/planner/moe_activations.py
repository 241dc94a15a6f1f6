"""Bytes a Mixture-of-Experts layer (paratrain.nn.moe) keeps for backward: its router, dispatch, experts and
combine, as paratrain runs them (paratrain.planner.activations adds it to the block that holds the layer)."""

from __future__ import annotations

from paratrain.config.model import ModelConfig


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
