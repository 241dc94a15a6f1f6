"""The rules of what changes over a run: the optimizer and its settings, the learning-rate schedule, a batch-size
ramp-up and a sequence-length warm-up (each size they pass through checked against the layout)."""

from __future__ import annotations

import re

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.model_rules import check_context_parallel, check_pipeline, check_tensor_parallel
from paratrain.config.parallel import ParallelConfig
from paratrain.config.plan import BatchRampup, SeqWarmup, batch_layout
from paratrain.config.run import LR_SCHEDULES, OPTIMIZERS, DataSection, OptimSection


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


def check_seq_warmup(data: DataSection, model: ModelConfig, parallel: ParallelConfig, seq_len: int) -> None:
    """A sequence warm-up every length of which the layout can run."""
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
