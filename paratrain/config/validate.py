"""Every rule a run must satisfy, checked in the launching process before any worker starts (and by
each worker against the world it meets: check_run gives the RunPlan it builds)."""

from __future__ import annotations

import math
import re
from dataclasses import fields, replace
from typing import Callable

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig, preset
from paratrain.config.parallel import PS_ON_CPU, ParallelConfig
from paratrain.config.rules import check_diloco_uses
from paratrain.config.model_rules import (check_context_parallel, check_experts, check_float8, check_grid_rows,
                                          check_pipeline, check_tensor_parallel)
from paratrain.config.plan import RunPlan, batch_layout
from paratrain.config.pp_layout import layout_split
from paratrain.config.run import FP8_RECIPES, PRECISIONS, RunConfig, TrainSection
from paratrain.config.schedules import check_optimizer, check_rampup, check_seq_warmup
from paratrain.config.world import DEVICES, check_min_nodes


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
    check_memory_copies(config)
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
    if data.workers < 1:
        raise ConfigError(f"data.workers (--data-workers) must be >= 1, got {data.workers}")
    check_tensor_parallel(model, parallel, seq_len)
    check_context_parallel(model, parallel, seq_len)
    check_experts(model, parallel)
    check_float8(model, parallel, config.train.precision)
    if parallel.dp_mode == "diloco":
        check_diloco_run(config, model)
    assert parallel.dp is not None
    micro_batch = data.micro_batch
    if not micro_batch and parallel.microbatches and data.global_batch % (parallel.dp * parallel.microbatches) == 0:
        micro_batch = data.global_batch // (parallel.dp * parallel.microbatches)  # SMP's way: say the count
    batch = batch_layout(data.global_batch, micro_batch, parallel.dp)
    if parallel.fault_tolerance == "replica":
        check_replica_run(config, parallel, batch.micro_batch)
    check_grid_rows(parallel, batch)
    check_pipeline(model, parallel, batch)
    if parallel.pp_layout and parallel.pp > 1:  # the run's pp_split, as the layout writes it for this model
        parallel = replace(parallel, pp_layout="", pp_split=layout_split(parallel.pp_layout, model.n_layer + 2,
                                                                         mtp_depth=model.mtp_depth))
    if data.batch_rampup:
        check_rampup(data, model, parallel)
    if data.seq_warmup:
        check_seq_warmup(data, model, parallel, seq_len)
    optim, train = config.optim, config.train
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {optim.lr}")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    if optim.grad_clip < 0 or optim.warmup_steps < 0:
        raise ConfigError("optim.grad_clip and optim.warmup_steps must be >= 0")
    if train.steps < 1:
        raise ConfigError(f"train.steps must be >= 1, got {train.steps}")
    if train.precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {train.precision!r}")
    if train.fp8_recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {train.fp8_recipe!r}")
    try:
        re.compile(train.fp8_skip)
    except re.error as error:
        raise ConfigError(f"train.fp8_skip must be a regex of linear names, got {train.fp8_skip!r}: {error}") from None
    for name in ("grad_dtype", "grad_reduce_dtype"):
        value = getattr(train, name)
        if value and value not in ("fp32", "bf16" if train.precision == "fp8" else train.precision):
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
    check_forensics(train, config.parallel)
    if train.fail_at:
        parts = train.fail_at.split(":")
        if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]) or parts[2:] not in (
                [], ["kill"], ["kill-backward"], ["hang"], ["kill-saving"], ["kill-node"]):
            raise ConfigError(f"train.fail_at must be 'RANK:STEP' (raise), 'RANK:STEP:kill' (SIGKILL), "
                              f"'RANK:STEP:kill-backward' (SIGKILL in that step's backward), "
                              f"'RANK:STEP:hang' (stop answering), 'RANK:STEP:kill-saving' (SIGKILL while saving "
                              f"the checkpoint of STEP) or 'RANK:STEP:kill-node' (SIGKILL its launcher and every "
                              f"worker of its node), e.g. '1:3', got {train.fail_at!r}")
        if parts[2:] == ["kill-node"] and world_size == 1:
            raise ConfigError("train.fail_at 'RANK:STEP:kill-node' kills the launcher of the rank's node and its "
                              "workers: one process runs without a launcher (it would kill what started it); use "
                              "--nproc 2 or more")
    return RunPlan(config=config, model=model, parallel=parallel, batch=batch, seq_len=seq_len)


LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""What --logger names (paratrain.train.loggers)."""


def check_loggers(names: str) -> tuple[str, ...]:
    """'jsonl,wandb' -> ('jsonl', 'wandb'); an unknown name refused with the list."""
    chosen = tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = [n for n in chosen if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"--logger {names!r}: unknown {unknown}; choose among {', '.join(LOGGERS)}")
    return chosen


def check_forensics(train: TrainSection, parallel: ParallelConfig) -> None:
    """The forensics flags (docs/forensics.md): well-formed, and with a layout they can watch."""
    for spec in filter(None, (part.strip() for part in train.inject.split(","))):
        kind, *numbers = spec.split(":")
        counts = {"bitflip": 2, "slow": 2, "spike": 1}
        if kind not in counts or len(numbers) != counts[kind] or not all(n.isdigit() for n in numbers):
            raise ConfigError(f"train.inject {spec!r}: write bitflip:RANK:STEP, slow:RANK:MS or spike:STEP "
                              "(comma-separated), e.g. --inject bitflip:1:5")
    for name in ("check_replicas", "profile", "memory_snapshot"):
        if getattr(train, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0, got {getattr(train, name)}")
    if train.check_replicas and parallel.zero == 3:
        raise ConfigError("--check-replicas compares the parameters data-parallel replicas hold, and ZeRO-3 keeps "
                          "none (each rank its own shard): use --zero 1 or 2 for the check")
    if (train.check_replicas or train.straggler_factor) and parallel.ps_mode != "off":
        raise ConfigError("--check-replicas and --straggler-factor watch collective data parallelism; the parameter "
                          "server's trainers hold no replicas to compare: use ps_mode 'off'")
    check_save_mode(train.save_mode, parallel.ps_mode)
    if train.straggler_factor and not (math.isfinite(train.straggler_factor) and train.straggler_factor > 1):
        raise ConfigError(f"train.straggler_factor must be a number > 1 (e.g. 1.5), or 0 to switch it off, got "
                          f"{train.straggler_factor}")
    if train.straggler_steps < 1:
        raise ConfigError(f"train.straggler_steps must be >= 1, got {train.straggler_steps}")
    skipped_batches(train.skip_batches)
    check_loggers(train.logger)
    if train.spike_policy not in ("off", "skip", "rollback"):
        raise ConfigError(f"train.spike_policy must be 'off', 'skip' or 'rollback', got {train.spike_policy!r}")
    if train.spike_policy != "off":
        if not (math.isfinite(train.spike_sigma) and train.spike_sigma > 0) or train.spike_window < 5:
            raise ConfigError(f"train.spike_sigma must be > 0 and spike_window >= 5, got {train.spike_sigma} and "
                              f"{train.spike_window}")
        if train.log_every != 1:
            raise ConfigError(f"--spike-policy {train.spike_policy} reads every step's loss before the next step: it "
                              f"needs --log-every 1, got {train.log_every}")
        if parallel.ps_mode != "off":
            raise ConfigError("--spike-policy keeps the whole state to undo a step, which the parameter servers hold: "
                              "use ps_mode 'off'")


def skipped_batches(text: str) -> set[int]:
    """'3,10-12' -> {3, 10, 11, 12} (global batches, 1-based as steps are logged); refused unless well-formed."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(first) < 1 or int(last or first) < int(first):
            raise ConfigError(f"train.skip_batches {text!r}: write batch numbers and ranges from 1, e.g. 3,10-12")
        out.update(range(int(first), int(last or first) + 1))
    return out


def check_save_mode(save_mode: str, ps_mode: str) -> None:
    """'sync' or 'async'; async copies each trainer's pieces for a writer process, which the parameter server's
    slices (written by the servers themselves) do not take."""
    if save_mode not in ("sync", "async"):
        raise ConfigError(f"save_mode must be 'sync' or 'async', got {save_mode!r}")
    if save_mode == "async" and ps_mode != "off":
        raise ConfigError(f"save_mode 'async' copies each trainer's pieces for a writer process; the parameter "
                          f"servers (ps_mode {ps_mode!r}) write their own slices synchronously: use save_mode 'sync'")



def check_memory_copies(config: RunConfig) -> None:
    """--memory-copies K (paratrain.checkpoint.memory_copies): the asynchronous save's writers send the copies, to K
    other nodes' launchers."""
    copies, train, launch = config.train.memory_copies, config.train, config.launch
    if copies == 0:
        return
    if copies < 0:
        raise ConfigError(f"train.memory_copies must be >= 0, got {copies}")
    if train.save_mode != "async" or not train.save:
        raise ConfigError(f"--memory-copies {copies} keeps the asynchronous save's copies in other nodes' RAM: give "
                          "--save DIR --save-mode async (and --save-every N)")
    if launch.nnodes <= copies:
        raise ConfigError(f"--memory-copies {copies} puts each rank's copy on {copies} other node(s), and the job has "
                          f"{launch.nnodes} node(s) (--nnodes): a copy on its own node dies with it; give "
                          f"--memory-copies {launch.nnodes - 1} or fewer, or 0 on one node")
    if config.parallel.fault_tolerance == "replica":
        raise ConfigError("--memory-copies serves a relaunch of the whole job (--max-restarts); under "
                          "--fault-tolerance replica the groups recover from each other live: give one of the two")


def check_diloco_run(config: RunConfig, model: ModelConfig) -> None:
    """What a DiLoCo run (dp_mode 'diloco') does not do in this version, refused by name before launch."""
    check_diloco_uses(plan_auto=config.launch.plan == "auto", muon=config.optim.optimizer == "muon",
                      spike=config.train.spike_policy != "off",
                      expert_bias=model.expert_bias_rate > 0 or model.global_aux_coef > 0)


def check_replica_batch(parallel: ParallelConfig, batch: int, micro_batch: int) -> None:
    """Under fault_tolerance replica: every count of live groups divides the global batch into whole micro-batches."""
    assert parallel.dp is not None
    groups, inside = parallel.replica_groups, parallel.dp // parallel.replica_groups
    for live in range(1, groups + 1):
        if batch % (live * inside * micro_batch):
            raise ConfigError(f"fault_tolerance replica divides each global batch ({batch}) among the live replica "
                              f"groups' dp ranks ({inside} a group) in micro-batches of {micro_batch}: with {live} of "
                              f"{groups} groups left that is {live * inside} x {micro_batch} rows, which does not "
                              f"divide it; use a global batch that every count of groups divides (a multiple of "
                              f"{math.lcm(*range(1, groups + 1)) * inside * micro_batch})")


def check_replica_run(config: RunConfig, parallel: ParallelConfig, micro_batch: int) -> None:
    """Fault tolerance by replica groups (paratrain.topology.quorum): the global batch divides among any number of
    surviving groups, and what this version does not compose with it, refused by name."""
    check_replica_batch(parallel, config.data.global_batch, micro_batch)
    groups, launch = parallel.replica_groups, config.launch
    given = [what for what, on in (
        ("--plan auto", launch.plan == "auto"),
        ("--spike-policy", config.train.spike_policy != "off"),
        ("--max-restarts (start a lost group again with --replica-group G --lighthouse HOST:PORT: it joins the "
         "running job)", launch.max_restarts > 0),
        ("--device cuda (each group's launcher would number its GPUs from 0, and a joiner's state travels over "
         "gloo's CPU point-to-point)", launch.device == "cuda"),
        ("--batch-rampup (its batches are checked against the whole dp only)", bool(config.data.batch_rampup)),
        ("--save with --dp-mode diloco (each group's inner state is its own, and replica group 0 writes only its "
         "own: the groups recover from each other live)", parallel.dp_mode == "diloco" and bool(config.train.save)),
    ) if on]
    if given:
        raise ConfigError("fault_tolerance replica with " + "; ".join(given) + ": not built in this version; drop them")
    if launch.replica_group < 0 and groups % launch.nnodes:
        raise ConfigError(f"fault_tolerance replica runs whole replica groups on each node: replica_groups ({groups}) "
                          f"must be a multiple of the nodes ({launch.nnodes}, --nnodes): give --replica-groups "
                          f"{launch.nnodes} or a multiple of it")
    if launch.replica_group >= groups or (launch.replica_group >= 0) != bool(launch.lighthouse):
        raise ConfigError(f"--replica-group G (0 .. {groups - 1}) starts one replica group of a running job and "
                          f"needs --lighthouse HOST:PORT (its first launcher prints it), got --replica-group "
                          f"{launch.replica_group} --lighthouse {launch.lighthouse!r}: give both, or neither")
