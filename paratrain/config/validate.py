"""Every rule a run must satisfy, checked in the launching process before any worker starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig, preset
from paratrain.config.parallel import ParallelConfig
from paratrain.config.run import RunConfig


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch of samples is cut: G = micro_batch x accumulation x dp."""

    global_batch: int
    micro_batch: int
    dp: int

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp


def batch_layout(global_batch: int, micro_batch: int, dp: int) -> BatchLayout:
    """Check G = m x accumulation x dp; micro_batch 0 means no accumulation."""
    if global_batch < 1:
        raise ConfigError(f"global_batch must be >= 1, got {global_batch}")
    if global_batch % dp:
        lower = dp * (global_batch // dp)
        nearest = [g for g in (lower, lower + dp) if g > 0]
        raise ConfigError(
            f"global_batch ({global_batch}) must be divisible by dp ({dp}): "
            f"choose global_batch in {nearest} or another dp"
        )
    per_rank = global_batch // dp
    micro = micro_batch or per_rank
    if micro < 1:
        raise ConfigError(f"micro_batch must be >= 1, got {micro_batch}")
    if per_rank % micro:
        choices = _divisors(per_rank)
        raise ConfigError(
            f"accumulation = global_batch / (micro_batch x dp) = {global_batch} / ({micro} x {dp}) "
            f"= {global_batch / (micro * dp):g} is not an integer: choose micro_batch in {choices}, "
            f"or global_batch a multiple of {micro * dp}"
        )
    return BatchLayout(global_batch=global_batch, micro_batch=micro, dp=dp)


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) (a global batch may be 10**9)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class RunPlan:
    """A RunConfig checked and resolved: what the workers build."""

    config: RunConfig
    model: ModelConfig
    parallel: ParallelConfig
    batch: BatchLayout
    seq_len: int


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, *, gpus: int) -> str:
    """'cpu' or 'cuda' for a requested device, given the GPUs this node sees: 'auto' is CUDA when
    there is one, else the CPU."""
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise ConfigError("device cuda was asked for, but torch sees no CUDA GPU on this node (a CPU build of torch, "
                          "or CUDA_VISIBLE_DEVICES empty): use device cpu")
    return device


def launch_world_size(config: RunConfig, *, gpus: int) -> int:
    """Processes the launcher will start: nproc x nnodes. Without --nproc, nproc follows --dp
    (dp x tp x pp / nnodes), else one per visible GPU on CUDA, 2 on the CPU. `gpus`: the CUDA
    devices this node sees; under NCCL each process takes one, so a node may not start more."""
    launch, parallel = config.launch, config.parallel
    if launch.nproc < 0:
        raise ConfigError(f"nproc ({launch.nproc}) must be >= 1 processes per node (or 0: one per GPU on CUDA, "
                          "dp x tp x pp / nnodes when --dp is given, else 2)")
    if launch.nnodes < 1:
        raise ConfigError(f"nnodes ({launch.nnodes}) must be >= 1")
    for axis in ("dp", "tp", "pp"):
        degree = getattr(parallel, axis)
        if degree is not None and degree < 1:
            raise ConfigError(f"{axis} ({degree}) must be >= 1")
    device = resolve_device(launch.device, gpus=gpus)
    if launch.nproc:
        per_node = launch.nproc
    elif parallel.dp is None:
        per_node = gpus if device == "cuda" else 2
    else:
        world = parallel.dp * parallel.tp * parallel.pp
        if world % launch.nnodes:
            raise ConfigError(
                f"dp x tp x pp = {world} processes do not split evenly over {launch.nnodes} nodes: "
                f"give --nproc (processes per node) or another dp"
            )
        per_node = world // launch.nnodes
    if device == "cuda" and per_node > gpus:
        raise ConfigError(
            f"{per_node} processes per node on CUDA need {per_node} GPUs (NCCL gives each process one), but this node "
            f"sees {gpus}: start at most {gpus} per node (--nproc {gpus}, and a layout whose dp x tp x pp is "
            f"{gpus} x nnodes), or train on the CPU with --device cpu (gloo)"
        )
    return per_node * launch.nnodes


def check_min_nodes(config: RunConfig) -> None:
    """--min-nodes: a relaunch may meet with fewer nodes, so dp must follow the world and every world
    from min_nodes to nnodes nodes must be a valid layout (checked by the caller, prepare_launch)."""
    launch = config.launch
    if not 1 <= launch.min_nodes <= launch.nnodes:
        raise ConfigError(f"min_nodes ({launch.min_nodes}) must be in 1..nnodes ({launch.nnodes}): the fewest nodes a "
                          "relaunch may go on with")
    if launch.min_nodes < launch.nnodes:
        if launch.rdzv_backend != "c10d":
            raise ConfigError(f"--min-nodes {launch.min_nodes} < --nnodes {launch.nnodes} needs --rdzv-backend c10d: "
                              "the static rendezvous has fixed node ranks and waits for every node")
        if not launch.max_restarts:
            raise ConfigError(f"--min-nodes {launch.min_nodes} takes effect when the job is relaunched: give "
                              "--max-restarts N (and --save DIR)")
        if config.parallel.dp is not None:
            raise ConfigError(f"--min-nodes {launch.min_nodes} recomputes dp from the nodes that meet: drop --dp "
                              f"{config.parallel.dp} (dp = processes / (tp x pp))")


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig, seq_len: int) -> None:
    """tp splits attention heads, the MLP's hidden width and the padded vocabulary; sequence
    parallelism splits the sequence. Each must divide evenly."""
    tp = parallel.tp
    if tp == 1:
        return

    def divisors(n: int) -> list[int]:
        return [t for t in range(1, n + 1) if n % t == 0 and t <= 64]

    if model.n_head % tp:
        raise ConfigError(
            f"tp ({tp}) must divide the attention heads (n_head = {model.n_head}), since each tp rank "
            f"computes whole heads: choose tp in {divisors(model.n_head)}"
        )
    if model.ff_dim % tp:
        raise ConfigError(
            f"tp ({tp}) must divide the MLP width (ff_dim = {model.ff_dim}): choose tp in "
            f"{divisors(model.ff_dim)} or set model.d_ff to a multiple of {tp}"
        )
    if model.padded_vocab % tp:
        multiple = math.lcm(model.vocab_multiple, tp)
        padded = -(-model.vocab_size // multiple) * multiple
        raise ConfigError(
            f"tp ({tp}) must divide the padded vocabulary: vocab_size {model.vocab_size} rounded up to a "
            f"multiple of vocab_multiple ({model.vocab_multiple}) is {model.padded_vocab}. Set "
            f"model.vocab_multiple = {multiple} (pads to {padded}; padding rows are never predicted)"
        )
    if parallel.sequence_parallel and seq_len % tp:
        lower = seq_len - seq_len % tp
        raise ConfigError(
            f"sequence parallelism splits each sequence over tp ({tp}) ranks, and seq_len ({seq_len}) "
            f"is not a multiple of it: set data.seq_len to {lower} or {lower + tp}"
        )


def check_experts(model: ModelConfig, parallel: ParallelConfig, *, compile: bool | str = False) -> None:
    """Mixture-of-Experts with the layout and the run's settings (compile: train.compile)."""
    if not model.n_experts:
        if parallel.ep > 1:
            raise ConfigError(f"ep={parallel.ep} divides the experts of a Mixture-of-Experts model among ranks, and "
                              f"this model is dense: give --experts N (a multiple of {parallel.ep}) or drop --ep")
        return
    if model.n_experts % parallel.ep:
        choices = [e for e in range(1, model.n_experts + 1) if model.n_experts % e == 0]
        raise ConfigError(f"ep ({parallel.ep}) must divide the experts ({model.n_experts}): choose ep in {choices}")
    if parallel.sequence_parallel:
        raise ConfigError("sequence parallelism splits each sequence over the tp ranks, and a MoE layer routes whole "
                          "sequences (capacity and the balancing loss are per sequence): drop --sequence-parallel")
    if compile:
        raise ConfigError("--compile with Mixture-of-Experts layers is not supported yet (routing makes shapes that "
                          "depend on the data): drop --compile")


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, batch: BatchLayout) -> None:
    """pp x virtual_stages chunks of at least one layer each; the schedule runs with the micro-batch
    count that the batch layout gives (the accumulation steps are the pipeline's micro-batches)."""
    from paratrain.pipeline.schedules import ScheduleError, check_schedule

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
    if launch.timeout_s <= 0:
        raise ConfigError(f"launch.timeout_s must be > 0 seconds, got {launch.timeout_s}: a collective needs time to "
                          "meet its peers (default 300)")
    if config.parallel.microbatches < 0:
        raise ConfigError(f"parallel.microbatches must be >= 0 (0: global_batch / (micro_batch x dp)), "
                          f"got {config.parallel.microbatches}")


def check_run(config: RunConfig, world_size: int) -> RunPlan:
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
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ConfigError(
            f"nnodes={launch.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address), "
            "the same on every node"
        )
    model = preset(config.model.preset, **config.model.overrides)  # type: ignore[arg-type]
    parallel = config.parallel.resolved(world_size)
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
    check_experts(model, parallel, compile=config.train.compile)
    assert parallel.dp is not None
    micro_batch = data.micro_batch
    if not micro_batch and parallel.microbatches and data.global_batch % (parallel.dp * parallel.microbatches) == 0:
        micro_batch = data.global_batch // (parallel.dp * parallel.microbatches)  # SMP's way: say the count
    batch = batch_layout(data.global_batch, micro_batch, parallel.dp)
    check_pipeline(model, parallel, batch)
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
