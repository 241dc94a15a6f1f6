"""The rules a model's shape and a layout must satisfy together: widths and heads against tp (and a grid's blocks),
the sequence against tp's sequence parallelism and cp's split, experts against ep, layers and micro-batches against
pp's schedule, a grid's rows against the micro-batch. check_run applies them before launch; the planner's search
applies them to every candidate."""

from __future__ import annotations

import math
from typing import Protocol

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig, ScheduleError, check_schedule
from paratrain.config.plan import BatchLayout
from paratrain.config.pp_layout import layout_split


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig, seq_len: int) -> None:
    """tp splits attention heads, the MLP's hidden width and the padded vocabulary; sequence
    parallelism splits the sequence. Each must divide evenly."""
    if parallel.tp == 1:
        return
    tp = parallel.tp_split  # 2d / 2.5d: the grid side q splits each
    grid = parallel.tp_mode != "1d"
    if grid and model.mtp_depth:
        raise ConfigError(f"tp_mode {parallel.tp_mode} with multi-token prediction (mtp_depth {model.mtp_depth}): the "
                          "grids do not cut the depths' norms and projection yet; use tp_mode 1d (with sequence "
                          "parallelism) or --mtp-depth 0")
    what = f"the {parallel.tp_mode} grid side q ({tp}, tp {parallel.tp})" if grid else f"tp ({tp})"
    if grid and model.d_model % tp:
        raise ConfigError(f"tp_mode {parallel.tp_mode} splits the model width over the grid side q = {tp} (tp "
                          f"{parallel.tp}), and d_model ({model.d_model}) is not a multiple of it: choose d_model a "
                          f"multiple of {tp}")

    def divisors(n: int) -> list[int]:
        return [t for t in range(1, n + 1) if n % t == 0 and t <= 64]

    if parallel.tp_mode == "3d":  # a matrix's output dim is cut q^2 ways (paratrain.tensor_parallel.cube)
        widths = {"d_model": model.d_model, "ff_dim": model.ff_dim, "the padded vocabulary": model.padded_vocab}
        for name, width in widths.items():
            if width % (tp * tp):
                raise ConfigError(f"tp_mode 3d cuts every weight's output dim into q^2 = {tp * tp} blocks (q = {tp}), "
                                  f"and {name} ({width}) is not a multiple of {tp * tp}: choose tp so that q^2 divides "
                                  f"it, or tp_mode 1d / 2d")

    if model.n_head % tp:
        raise ConfigError(
            f"{what} must divide the attention heads (n_head = {model.n_head}), since each tp rank "
            f"computes whole heads: choose tp in {divisors(model.n_head)}"
        )
    if model.ff_dim % tp:
        raise ConfigError(
            f"{what} must divide the MLP width (ff_dim = {model.ff_dim}): choose tp in "
            f"{divisors(model.ff_dim)} or set model.d_ff to a multiple of {tp}"
        )
    if model.padded_vocab % tp:
        multiple = math.lcm(model.vocab_multiple, tp)
        padded = -(-model.vocab_size // multiple) * multiple
        raise ConfigError(
            f"{what} must divide the padded vocabulary: vocab_size {model.vocab_size} rounded up to a "
            f"multiple of vocab_multiple ({model.vocab_multiple}) is {model.padded_vocab}. Set "
            f"model.vocab_multiple = {multiple} (pads to {padded}; padding rows are never predicted)"
        )
    if parallel.sequence_parallel and seq_len % tp:
        lower = seq_len - seq_len % tp
        raise ConfigError(
            f"sequence parallelism splits each sequence over tp ({tp}) ranks, and seq_len ({seq_len}) "
            f"is not a multiple of it: set data.seq_len to {lower} or {lower + tp}"
        )


def check_grid_rows(parallel: ParallelConfig, batch: BatchLayout) -> None:
    """tp_mode 2d splits each micro-batch's rows over the grid's q rows, 2.5d over tp_depth x q."""
    q = parallel.tp_row_parts
    if batch.micro_batch % q:
        raise ConfigError(f"tp_mode {parallel.tp_mode} splits each micro-batch's rows into {q} parts (the grid's rows"
                          f"{' times its depth' if parallel.tp_mode == '2.5d' else ''}), and micro_batch "
                          f"is {batch.micro_batch}: set micro_batch to a multiple of {q} (global_batch "
                          f"{batch.global_batch} = micro_batch x accumulation x dp {batch.dp})")


def check_context_parallel(model: ModelConfig, parallel: ParallelConfig, seq_len: int) -> None:
    """cp splits each sequence into 2 x cp equal chunks (the balanced causal split), and sequence
    parallelism this rank's part again over tp; Ulysses splits a tp rank's attention heads over cp."""
    cp = parallel.cp
    if cp == 1:
        return
    sp = parallel.tp if parallel.sequence_parallel else 1
    if seq_len % (2 * cp * sp):
        fits = [c for c in range(1, cp + 1) if seq_len % (2 * c * sp) == 0]
        then = f" and sequence parallelism each chunk pair into tp = {sp} parts" if sp > 1 else ""
        raise ConfigError(f"seq_len ({seq_len}) must divide into 2 x cp = {2 * cp} equal chunks{then} (rank r holds "
                          f"chunks r and {2 * cp - 1} - r, so causal attention costs every rank the same): choose cp in "
                          f"{fits} or a seq_len that is a multiple of {2 * cp * sp}")
    heads = model.n_head // parallel.tp
    if parallel.cp_mode == "ulysses" and heads % cp:
        fits = [c for c in range(1, cp + 1) if heads % c == 0]
        raise ConfigError(f"cp_mode ulysses splits a tp rank's attention heads over cp: n_head / tp = {heads} % cp "
                          f"({cp}) must be 0; choose cp in {fits} or --cp-mode ring")
    if parallel.cp_mode == "usp" and heads % parallel.cp_ulysses:
        fits = [u for u in range(2, cp) if cp % u == 0 and heads % u == 0]
        fix = f"choose --cp-ulysses in {fits}" if fits else "use --cp-mode ring"
        raise ConfigError(f"cp_mode usp splits a tp rank's attention heads over its Ulysses groups: n_head / tp = "
                          f"{heads} % cp_ulysses ({parallel.cp_ulysses}) must be 0; {fix}")
    if parallel.cp_balance == "documents":
        keyed = [f"{name} {value:g}" for name, value in (("dropout", model.dropout), ("mtp_depth", model.mtp_depth),
                 ("capacity_factor", model.capacity_factor if model.n_experts else 0.0)) if value]
        if keyed:
            raise ConfigError(f"cp_balance documents splits each micro-batch by its documents, and {', '.join(keyed)} "
                              "read each token's window position from the fixed split (dropout masks, MTP's shift, "
                              "per-sequence expert capacity): set them to 0, or cp_balance positions")


def check_experts(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Mixture-of-Experts with the layout: ep divides the experts, expert_tp their width."""
    if not model.n_experts:
        if parallel.ep > 1 or parallel.expert_tp:
            flag, fix = ("--ep", f"(a multiple of {parallel.ep}) ") if parallel.ep > 1 else ("--expert-tp", "")
            raise ConfigError(f"{flag} splits the experts of a Mixture-of-Experts model among ranks, and this model "
                              f"is dense: give --experts N {fix}or drop {flag}")
        return
    if model.n_experts % parallel.ep:
        choices = [e for e in range(1, model.n_experts + 1) if model.n_experts % e == 0]
        raise ConfigError(f"ep ({parallel.ep}) must divide the experts ({model.n_experts}): choose ep in {choices}")
    if model.expert_bias_rate > 0 and parallel.ps_mode != "off":
        raise ConfigError(f"the balancing bias (expert_bias_rate {model.expert_bias_rate:g}) moves from the global "
                          f"batch's counts after each step, which the parameter server's update (ps_mode "
                          f"{parallel.ps_mode!r}) does not see: use ps_mode 'off', or --expert-bias 0 with the "
                          "auxiliary loss")
    if model.global_aux_coef > 0 and parallel.ps_mode != "off":
        raise ConfigError(f"the global-batch balancing loss (global_aux_coef {model.global_aux_coef:g}) reads the "
                          f"previous global batch's counts, which the parameter server's update (ps_mode "
                          f"{parallel.ps_mode!r}) does not see: use ps_mode 'off', or --global-aux-coef 0")
    if parallel.expert_tp and model.expert_dim % parallel.tp:
        raise ConfigError(f"expert_tp cuts each expert's width ({model.expert_dim}) over tp = {parallel.tp}: it must "
                          "divide; set d_expert to a multiple of tp or drop --expert-tp")


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, batch: BatchLayout) -> None:
    """pp x virtual_stages chunks of at least one layer each; the schedule runs with the micro-batch
    count that the batch layout gives (the accumulation steps are the pipeline's micro-batches)."""

    m = batch.accumulation
    if parallel.microbatches and parallel.microbatches != m:
        raise ConfigError(
            f"microbatches ({parallel.microbatches}) must equal global_batch / (micro_batch x dp) = "
            f"{batch.global_batch} / ({batch.micro_batch} x {batch.dp}) = {m}: the micro-batches of a pipeline "
            f"step are the accumulation steps; set micro_batch = {batch.global_batch // (parallel.microbatches * batch.dp)}"
            if batch.global_batch % (parallel.microbatches * batch.dp) == 0 else
            f"microbatches ({parallel.microbatches}) must equal global_batch / (micro_batch x dp) = {m}")
    if parallel.pp == 1:
        return
    chunks = parallel.pp * parallel.virtual_stages
    layers = model.n_layer + 2  # embedding, blocks, head
    if chunks > layers:
        raise ConfigError(f"pp x virtual_stages = {chunks} chunks need at least as many layers; the model has "
                          f"{layers} (embedding, {model.n_layer} blocks, head): lower pp or virtual_stages")
    if parallel.pp_layout:
        layout_split(parallel.pp_layout, layers, mtp_depth=model.mtp_depth)
    if parallel.pp_split:
        split = list(parallel.pp_split)
        if len(split) != chunks - 1 or split != sorted(set(split)) or split[0] < 1 or split[-1] >= layers:
            raise ConfigError(f"pp_split {split} must be {chunks - 1} increasing layer indices in 1..{layers - 1} "
                              f"(the first layer of chunks 1..{chunks - 1}; 0 is the embedding, {layers - 1} the head)")
    try:
        check_schedule(parallel.schedule, parallel.pp, m, parallel.virtual_stages)
    except ScheduleError as error:
        raise ConfigError(str(error)) from None


FLOAT8_MULTIPLE = 16
"""torch._scaled_mm's rule on CUDA: every matmul dimension a multiple of 16 (paratrain.memory.float8 keeps it on every
device)."""


class TensorCut(Protocol):
    """How tp cuts each layer (ParallelConfig and ParallelDims have it)."""

    tp: int
    tp_mode: str


def check_float8_layout(layout: TensorCut) -> None:
    """Precision fp8 under tensor parallelism: 1d, 2d and 2.5d (the 3d cube's blocks do not multiply in float8 yet)."""
    if layout.tp > 1 and layout.tp_mode == "3d":
        raise ConfigError("precision fp8 under tp_mode 3d: the cube's blocks do not multiply in float8 yet; use "
                          "tp_mode 1d, 2d or 2.5d, or precision bf16")


def check_float8(model: ModelConfig, parallel: ParallelConfig, precision: str) -> None:
    """Precision fp8: not the 3d cube (its blocks are not float8 yet), and the block linears' widths multiples of 16
    in each slice tp cuts them into. A Hugging Face model's own widths are checked again when its linears are made
    float8 (paratrain.memory.float8.float8_linears)."""
    if precision != "fp8":
        return
    check_float8_layout(parallel)
    multiple = FLOAT8_MULTIPLE * parallel.tp_split
    widths = {"d_model": model.d_model, "the MLP's width": model.ff_dim}
    unfit = [f"{name} {value}" for name, value in widths.items() if value % multiple]
    if unfit:
        raise ConfigError(f"precision fp8 multiplies the blocks' linears in float8, which needs each width a multiple "
                          f"of {FLOAT8_MULTIPLE} in each of the {parallel.tp_split} slices tp cuts it into (of "
                          f"{multiple} whole): {', '.join(unfit)}. Change the widths, or use precision bf16")
