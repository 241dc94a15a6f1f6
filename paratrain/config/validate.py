"""Every rule a run must satisfy, checked in the launching process before any worker starts (and by
each worker against the world it meets: check_run gives the RunPlan it builds)."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Callable

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig, preset
from paratrain.config.parallel import PS_ON_CPU, ParallelConfig, ScheduleError, check_schedule
from paratrain.config.plan import BatchLayout, BatchRampup, RunPlan, SeqWarmup, batch_layout
from paratrain.config.run import LR_SCHEDULES, OPTIMIZERS, DataSection, OptimSection, RunConfig
from paratrain.config.world import DEVICES, check_min_nodes


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig, seq_len: int) -> None:
    """tp splits attention heads, the MLP's hidden width and the padded vocabulary; sequence
    parallelism splits the sequence. Each must divide evenly."""
    if parallel.tp == 1:
        return
    tp = parallel.tp_split  # 2d / 2.5d: the grid side q splits each
    grid = parallel.tp_mode != "1d"
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
    if parallel.pp_split:
        split = list(parallel.pp_split)
        if len(split) != chunks - 1 or split != sorted(set(split)) or split[0] < 1 or split[-1] >= layers:
            raise ConfigError(f"pp_split {split} must be {chunks - 1} increasing layer indices in 1..{layers - 1} "
                              f"(the first layer of chunks 1..{chunks - 1}; 0 is the embedding, {layers - 1} the head)")
    try:
        check_schedule(parallel.schedule, parallel.pp, m, parallel.virtual_stages)
    except ScheduleError as error:
        raise ConfigError(str(error)) from None


def check_numbers(config: RunConfig) -> None:
    """Every number of every section is finite (nan and inf are refused by name), and those that
    cannot be negative or zero are not: the rules no other check covers."""
    sections = {"parallel": config.parallel, "data": config.data, "optim": config.optim, "train": config.train,
                "launch": config.launch}
    for section_name, section in sections.items():
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section_name}.{f.name} must be a finite number, got {value}")
    for key, value in config.model.overrides.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"model.{key} must be a finite number, got {value}")
    if config.seed < 0:
        raise ConfigError(f"seed must be >= 0, got {config.seed}")
    optim, launch = config.optim, config.launch
    if optim.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(optim, name) < 1.0:
            raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(optim, name)} (AdamW's usual: 0.9, 0.95)")
    if optim.eps <= 0:
        raise ConfigError(f"optim.eps must be > 0, got {optim.eps} (AdamW's usual: 1e-8)")
    check_optimizer(optim, config.parallel)
    if launch.timeout_s <= 0:
        raise ConfigError(f"launch.timeout_s must be > 0 seconds, got {launch.timeout_s}: a collective needs time to "
                          "meet its peers (default 300)")
    if config.parallel.microbatches < 0:
        raise ConfigError(f"parallel.microbatches must be >= 0 (0: global_batch / (micro_batch x dp)), "
                          f"got {config.parallel.microbatches}")


ModelShape = Callable[[RunConfig, ParallelConfig], ModelConfig]
"""A run's model as the rules read it (widths, heads, layers, vocabulary), given the run and its resolved layout."""


def preset_shape(config: RunConfig, parallel: ParallelConfig) -> ModelConfig:
    """check_run's default ModelShape: the GPT preset with the run's overrides. A Hugging Face folder's shape is
    read from its config.json by paratrain.hf.load.run_model_shape (a room above this one), which the CLI passes."""
    if config.model.hf:
        raise ConfigError(f"model.hf {config.model.hf!r}: a Hugging Face folder's shape is read by "
                          "paratrain.hf.load.run_model_shape: call check_run(config, world_size, "
                          "model_shape=run_model_shape)")
    return preset(config.model.preset, **config.model.overrides)  # type: ignore[arg-type]


def check_run(config: RunConfig, world_size: int, *, model_shape: ModelShape = preset_shape) -> RunPlan:
    """All the rules of a run, in the order a user would want to hear of them."""
    if world_size < 1:
        raise ConfigError(f"the world size must be >= 1, got {world_size}")
    check_numbers(config)
    launch = config.launch
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ConfigError(f"node_rank ({launch.node_rank}) must be in 0..{launch.nnodes - 1}")
    if launch.rdzv_backend not in ("static", "c10d"):
        raise ConfigError(f"rdzv_backend must be 'static' or 'c10d', got {launch.rdzv_backend!r}")
    if launch.max_restarts < 0:
        raise ConfigError(f"launch.max_restarts must be >= 0, got {launch.max_restarts}")
    if launch.min_nodes:
        check_min_nodes(config)
    if launch.max_restarts and not config.train.save:
        raise ConfigError(f"--max-restarts {launch.max_restarts} restarts failed workers from the newest verified "
                          "checkpoint under --save: give --save DIR (and --save-every N, how far a restart goes back)")
    if launch.device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {launch.device!r}")
    if launch.device == "cuda" and config.parallel.ps_mode != "off":
        raise ConfigError(PS_ON_CPU)
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ConfigError(
            f"nnodes={launch.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address), "
            "the same on every node"
        )
    parallel = config.parallel.resolved(world_size)
    model = model_shape(config, parallel)
    data = config.data
    seq_len = data.seq_len or model.seq_len
    if seq_len > model.seq_len:
        raise ConfigError(
            f"data.seq_len ({seq_len}) must be <= the model's seq_len ({model.seq_len}): "
            f"lower --seq-len or raise model.seq_len"
        )
    if seq_len < 2:
        raise ConfigError(f"data.seq_len must be >= 2, got {seq_len}")
    if not 0.0 < data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {data.val_fraction}")
    check_tensor_parallel(model, parallel, seq_len)
    check_context_parallel(model, parallel, seq_len)
    check_experts(model, parallel)
    assert parallel.dp is not None
    micro_batch = data.micro_batch
    if not micro_batch and parallel.microbatches and data.global_batch % (parallel.dp * parallel.microbatches) == 0:
        micro_batch = data.global_batch // (parallel.dp * parallel.microbatches)  # SMP's way: say the count
    batch = batch_layout(data.global_batch, micro_batch, parallel.dp)
    check_grid_rows(parallel, batch)
    check_pipeline(model, parallel, batch)
    if data.batch_rampup:
        check_rampup(data, model, parallel)
    if data.seq_warmup:
        try:
            warmup = SeqWarmup.parse(data.seq_warmup, seq_len)
        except ValueError as error:
            raise ConfigError(f"data.seq_warmup: {error}") from None
        if data.path:
            raise ConfigError("data.seq_warmup with a mixture (--data-path) is not built: warm up one source")
        for length in warmup.lengths():
            try:
                check_tensor_parallel(model, parallel, length)
                check_context_parallel(model, parallel, length)
            except ConfigError as error:
                raise ConfigError(f"data.seq_warmup passes through sequences of {length} tokens: {error}") from None
    optim, train = config.optim, config.train
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    if optim.grad_clip < 0 or optim.warmup_steps < 0:
        raise ConfigError("optim.grad_clip and optim.warmup_steps must be >= 0")
    if train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
    if train.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision must be 'fp32', 'bf16' or 'fp16', got {train.precision!r}")
    for name in ("grad_dtype", "grad_reduce_dtype"):
        value = getattr(train, name)
        if value and value not in ("fp32", train.precision):
            raise ConfigError(f"train.{name} must be 'fp32' or the precision's own ({train.precision!r}), got "
                              f"{value!r}: gradients are kept in float32 or in the parameters' 16 bits")
    for name in ("eval_every", "save_every", "keep_last", "eval_batches", "sample_tokens"):
        if getattr(train, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(train, name)}")
    if train.recompute not in ("none", "full", "selective"):
        raise ConfigError(f"train.recompute must be 'none', 'full' or 'selective', got {train.recompute!r}")
    if train.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"train.nan_policy must be 'stop' or 'skip', got {train.nan_policy!r}")
    if train.nan_skips < 0:
        raise ConfigError(f"train.nan_skips must be >= 0, got {train.nan_skips}")
    if train.log_every < 1:
        raise ConfigError(f"train.log_every must be >= 1, got {train.log_every}")
    if train.fail_at:
        parts = train.fail_at.split(":")
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]) or parts[2:] not in (
                [], ["kill"], ["hang"], ["kill-saving"], ["kill-node"]):
            raise ConfigError(f"train.fail_at must be 'RANK:STEP' (raise), 'RANK:STEP:kill' (SIGKILL), "
                              f"'RANK:STEP:hang' (stop answering), 'RANK:STEP:kill-saving' (SIGKILL while saving "
                              f"the checkpoint of STEP) or 'RANK:STEP:kill-node' (SIGKILL its launcher and every "
                              f"worker of its node), e.g. '1:3', got {train.fail_at!r}")
        if parts[2:] == ["kill-node"] and world_size == 1:
            raise ConfigError("train.fail_at 'RANK:STEP:kill-node' kills the launcher of the rank's node and its "
                              "workers: one process runs without a launcher (it would kill what started it); use "
                              "--nproc 2 or more")
    return RunPlan(config=config, model=model, parallel=parallel, batch=batch, seq_len=seq_len)


def check_optimizer(optim: OptimSection, parallel: ParallelConfig) -> None:
    """The optimizer, its schedule and Muon's settings (paratrain.optim.MuonSettings holds the same ranges)."""
    if optim.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optim.optimizer must be one of {OPTIMIZERS}, got {optim.optimizer!r}")
    if optim.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {optim.lr_schedule!r}")
    if not 0 < optim.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction must be in (0, 1], got {optim.decay_fraction} (the share of the steps "
                          "wsd spends decaying; usual 0.1-0.2)")
    if optim.state_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"optim.state_dtype must be 'fp32' or 'bf16', got {optim.state_dtype!r}")
    if optim.state_dtype != "fp32" and optim.optimizer == "sgd":
        raise ConfigError("optim.state_dtype 'bf16' is for AdamW's moments and Muon's momentum; sgd keeps its "
                          "momentum in the parameters' dtype: use optimizer 'adamw' or 'muon', or state_dtype 'fp32'")
    if optim.optimizer != "muon":
        return
    if not 0 <= optim.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum must be in [0, 1), got {optim.muon_momentum} (usual: 0.95)")
    if not 1 <= optim.muon_ns_steps < 100:
        raise ConfigError(f"optim.muon_ns_steps must be in [1, 100), got {optim.muon_ns_steps} (usual: 5)")
    if optim.muon_ns_dtype not in ("bf16", "fp32", "fp64"):
        raise ConfigError(f"optim.muon_ns_dtype must be 'bf16', 'fp32' or 'fp64', got {optim.muon_ns_dtype!r}")
    if optim.muon_adjust_lr not in ("original", "match_rms_adamw", "none"):
        raise ConfigError("optim.muon_adjust_lr must be 'original', 'match_rms_adamw' or 'none', got "
                          f"{optim.muon_adjust_lr!r}")
    try:
        re.compile(optim.muon_exclude)
    except re.error as error:
        raise ConfigError(f"optim.muon_exclude is not a regular expression ({error}): {optim.muon_exclude!r}") from None
    if parallel.ps_mode != "off":
        raise ConfigError(f"optim.optimizer 'muon' with ps_mode {parallel.ps_mode!r}: Muon needs each whole matrix, "
                          "which the parameter server's slices do not give; use ps_mode 'off' (ZeRO-1/2/3 shard its "
                          "state over dp) or optimizer 'adamw'")


def check_rampup(data: DataSection, model: ModelConfig, parallel: ParallelConfig) -> None:
    """A batch ramp-up every size of which the layout can run with the run's micro-batch."""
    try:
        rampup = BatchRampup.parse(data.batch_rampup, data.global_batch)
    except ValueError as error:
        raise ConfigError(f"data.batch_rampup: {error}") from None
    if not data.micro_batch:
        raise ConfigError("data.batch_rampup needs an explicit --micro-batch: the micro-batch stays fixed while the "
                          "number of micro-batches per step grows")
    if data.path:
        raise ConfigError("data.batch_rampup with a mixture (--data-path) is not built: ramp up one source, or train "
                          "the mixture at its full global batch")
    assert parallel.dp is not None
    for size in rampup.sizes():
        try:
            check_pipeline(model, parallel, batch_layout(size, data.micro_batch, parallel.dp))
        except ConfigError as error:
            raise ConfigError(f"data.batch_rampup passes through a global batch of {size}: {error}") from None
