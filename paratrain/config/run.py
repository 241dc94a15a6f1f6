"""Typed configuration of a training run: one dataclass per section of the TOML file.

Precedence: dataclass defaults < the TOML file (--config) < command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.config.parallel import ParallelConfig


@dataclass
class ModelSection:
    preset: str = "small"
    """Name of a preset in paratrain.config.model.PRESETS."""
    overrides: dict[str, object] = field(default_factory=dict)
    """Fields of ModelConfig to change from the preset, e.g. {"n_layer": 2}."""
    hf: str = ""
    """A local Hugging Face checkpoint folder (config.json, safetensors) to train instead of the preset
    (paratrain.hf.from_pretrained: Llama, Mistral, Qwen2/3, Gemma, GPT-2); its weights are read piece by piece on each rank."""


@dataclass
class DataSection:
    source: str = "builtin"
    """'builtin' (CPython's pydoc topics), a text file (.txt, .jsonl, .parquet), a folder of token files
    (`paratrain tokenize`'s or Megatron's indexed train / val, or nanoGPT's uint16 train.bin / val.bin), a Megatron
    prefix, or a folder of shards (.bin/.idx pairs, or .jsonl / .parquet text; paratrain.data.shards). Text is read as
    UTF-8 bytes by the GPT, and tokenized by the model's own tokenizer with --hf (paratrain.data.text)."""
    workers: int = 1
    """Processes that tokenize a folder of text shards for --hf, a shard each (the same tokens for any number)."""
    cache: str = ""
    """Where text tokenized for --hf is kept ('': $XDG_CACHE_HOME/paratrain/tokens, or ~/.cache/...)."""
    split: str = ""
    """A Megatron prefix's train, validation and test shares ('': Megatron's 969,30,1; paratrain.data.corpora)."""
    path: tuple[str, ...] = ()
    """A weighted mixture, Megatron's spelling: weight, source, weight, source, ... (paratrain.data.mixture); each
    source any `source` above but text. Replaces `source` when given."""
    schedule: str = ""
    """The mixture's weights by step, 'STEP:W1,W2,...;STEP:...' from step 0 ('': path's weights throughout)."""
    seq_len: int = 0
    """Tokens per sample; 0 means the model's seq_len."""
    global_batch: int = 32
    """Samples per optimizer step, over all data-parallel ranks together."""
    micro_batch: int = 0
    """Samples per forward/backward on one rank; 0 means global_batch / dp (no accumulation)."""
    seq_warmup: str = ""
    """'START,STEPS': samples read as sequences of START tokens, doubling to seq_len over the first STEPS steps
    (paratrain.config.plan.SeqWarmup: the same samples and targets); '': none."""
    batch_rampup: str = ""
    """'START,INCREMENT,SAMPLES': the global batch grows from START by INCREMENT over SAMPLES samples up to
    global_batch (Megatron's --rampup-batch-size; paratrain.data.loader.BatchRampup); '': fixed."""
    val_fraction: float = 0.1
    """Share of a single-file source held out for validation (the tail of the file)."""
    documents: str = "auto"
    """Document masking of packed windows (paratrain.nn.documents: positions restart at each document,
    attention stays inside it, no loss on the next document's first token): 'on' (needs a document index,
    a folder `paratrain tokenize` or Megatron wrote), 'off', or 'auto' (on for --hf models when the data has
    an index; never a function of the layout)."""


OPTIMIZERS = ("adamw", "muon", "sgd")
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")


@dataclass
class OptimSection:
    optimizer: str = "adamw"
    """'adamw'; 'muon' (Muon on the weight matrices, AdamW on embeddings, head, norms and biases: paratrain.optim;
    every layout); 'sgd' (momentum 0.9, no weight decay)."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup (Muon's too: muon_adjust_lr scales it per matrix)."""
    lr_schedule: str = "cosine"
    """After warmup: 'cosine' to lr * min_lr_ratio at the last step; 'wsd' (warmup-stable-decay) flat, then the last
    decay_fraction of the steps linearly down to lr * min_lr_ratio; 'linear' straight down to it; 'constant'."""
    decay_fraction: float = 0.2
    """wsd: the share of the steps spent decaying (MiniCPM, DeepSeek: 0.1-0.2)."""
    min_lr_ratio: float = 0.1
    """The schedule ends at lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms, not biases); Muon's and AdamW's."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    state_dtype: str = "fp32"
    """Optimizer state storage: 'fp32', or 'bf16' (AdamW's moments and Muon's momentum in bfloat16, half the bytes;
    updated in float32 from the float32 master and rounded back)."""
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per matrix and step."""
    muon_ns_dtype: str = "bf16"
    """Newton-Schulz dtype: 'bf16' (torch.optim.Muon's), 'fp32' or 'fp64' (exactness checks)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """'match_rms_adamw' (Moonshot's: 0.2 lr sqrt(max(rows, cols)), so one lr serves Muon and AdamW), 'original'
    (Keller Jordan's: lr sqrt(max(1, rows / cols)); give Muon's own lr, ~0.02) or 'none'."""
    muon_exclude: str = ""
    """Names (a regex) of 2-D parameters AdamW updates instead of Muon; empty: embeddings and output heads
    (paratrain.optim.EXCLUDE)."""


PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""The precision policies' names (paratrain.memory.precision.POLICIES holds each; a unit test checks the two agree)."""
FP8_RECIPES = ("tensorwise", "rowwise")
"""paratrain.memory.float8.FLOAT8_RECIPES's names."""


@dataclass
class TrainSection:
    steps: int = 300
    """Optimizer steps in the whole run (a resumed run continues to the same total)."""
    precision: str = "fp32"
    """'fp32', 'bf16' (autocast; under ZeRO 16-bit parameters, float32 masters), 'fp16' (and loss scaling) or 'fp8'
    (bf16, and the blocks' linears multiply in float8: docs/precision.md)."""
    fp8_recipe: str = "tensorwise"
    """Under fp8: 'tensorwise' (a scale per tensor; e4m3 forward, e5m2 gradients) or 'rowwise' (a scale per row;
    e4m3)."""
    fp8_skip: str = r"(^|\.)gate$"
    """Under fp8: a regex of the blocks' linears left in bf16 (default: Hugging Face MoE routers)."""
    grad_dtype: str = "fp32"
    """Under ZeRO with bf16 / fp16: gradients accumulate and are summed in 'fp32' (default) or the precision's own
    16 bits (half the bytes; DeepSpeed's default)."""
    grad_reduce_dtype: str = ""
    """The dtype gradients are reduced in; empty: grad_dtype's ('bf16' under fp32 buffers halves the wire bytes)."""
    recompute: str = "none"
    """'full': recompute each transformer block in backward, keeping only its input; 'selective':
    only each block's attention core (softmax(q k^T) v); 'none'."""
    compile: bool = False
    """torch.compile each transformer block (inductor; on the CPU it builds C++ with the system's
    compiler). Collectives and keyed dropout run eagerly between the compiled pieces."""
    eval_every: int = 50
    """Validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Global batches of held-out data per validation."""
    log_every: int = 1
    """Read the loss back and log every this many steps (steps in between wait for nothing)."""
    check_collectives: bool = False
    """Compare the ranks' sequences of collectives after every step (paratrain.comm.order), not only
    after the first one."""
    save: str = ""
    """Folder to write checkpoints to; empty: no checkpoints."""
    save_every: int = 0
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints under `save` (older ones are deleted once a newer one
    is complete); 0 keeps every one."""
    save_mode: str = "sync"
    """'sync': the step waits while every rank writes its pieces; 'async': it waits only for a copy of them into
    shared memory, and a writer process per rank writes and publishes them while training goes on
    (paratrain.checkpoint.async_save; the same files)."""
    memory_copies: int = 0
    """With save_mode 'async' across nodes: each rank's checkpoint is also kept in the RAM of its own node's launcher
    and of this many other nodes' (paratrain.checkpoint.memory_copies); a relaunch resumes from memory when the
    copy is at least as new as the newest checkpoint on disk. 0: disk only."""
    resume: str = ""
    """Checkpoint folder to resume from (its latest checkpoint, verified first), or 'auto': the newest
    checkpoint under `save` that verifies (none: start at step 0)."""
    log_json: str = ""
    """Write one JSON object per optimizer step to this path (rank 0)."""
    tensorboard: str = ""
    """Write the same records as TensorBoard scalars to this folder (rank 0; needs paratrain[viz])."""
    sample_tokens: int = 200
    """Length of the text sample generated at the end; 0 skips it."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    nan_policy: str = "stop"
    """A step whose loss or gradient norm is nan or inf (outside fp16's own overflow skip): 'stop' the
    run, naming the step, the ranks and the newest checkpoint; or 'skip' its update (every rank)."""
    nan_skips: int = 10
    """With nan_policy 'skip': the most non-finite steps a run may skip before it stops."""
    logger: str = ""
    """Loggers beside the ones named by path, comma-separated: jsonl, tensorboard, wandb, mlflow
    (paratrain.train.loggers); each writes under log_dir unless its own path is given."""
    log_dir: str = "paratrain-logs"
    inject: str = ""
    """Faults a run survives, for testing the tools that find them (paratrain.train.faults.Injection), comma-separated:
    'bitflip:RANK:STEP' (one bit of RANK's reduced gradient), 'slow:RANK:MS' (RANK sleeps MS ms a step),
    'spike:STEP' (a corrupted global batch)."""
    check_replicas: int = 0
    """Every N steps compare the parameters' fingerprints over the replicas that must agree and stop, naming the
    rank and tensor, on a mismatch (paratrain.train.replicas); 0: off."""
    straggler_factor: float = 0.0
    """Name a rank whose median busy time over straggler_steps steps is more than this many times the others'
    (paratrain.train.stragglers); 0: off."""
    straggler_steps: int = 5
    profile: int = 0
    """torch.profiler traces of this many steps, after a step of wait and one of warm-up, one file per rank under
    profile_dir (paratrain.train.profile); 0: off."""
    profile_dir: str = "paratrain-profile"
    memory_snapshot: int = 0
    """After this step (or at an out-of-memory error before it), each rank writes its measured memory beside the
    planner's prediction, and on CUDA the allocator's history, under profile_dir (paratrain.train.memory_snapshot);
    0: off."""
    spike_policy: str = "off"
    """A step whose loss exceeds the median of the last 5 by spike_sigma times the standard deviation of the
    step-to-step changes over the last spike_window losses: 'skip' its update, or 'rollback' (the state before it restored, the step taken again on the next batch); 'off'
    (paratrain.train.spikes)."""
    spike_sigma: float = 6.0
    spike_window: int = 50
    skip_batches: str = ""
    """Global batches to skip, '3,10-12': their step trains on the next batch instead (Megatron's
    --skip-train-iteration-range; after a spike, the data that caused it)."""
    fail_at: str = ""
    """Fault injection for testing crash handling: 'RANK:STEP' makes that rank raise at that step,
    'RANK:STEP:kill' kill itself with SIGKILL, 'RANK:STEP:hang' stop answering, 'RANK:STEP:kill-saving'
    SIGKILL itself while saving the checkpoint of STEP (its own file written, the checkpoint unpublished),
    'RANK:STEP:kill-node' SIGKILL its whole node: its launcher and every worker of it (Linux)."""


@dataclass
class LaunchSection:
    nproc: int = 0
    """Processes per node; 0: dp x tp x pp / nnodes when dp is set, else 2. The trainers: dedicated
    parameter servers come beside them (servers)."""
    servers: int = 0
    """Set by the launching process: the dedicated parameter servers this node starts after its nproc
    trainers (the last node starts every one of parallel.ps_servers, so that they are the world's last
    ranks)."""
    first_server: int = 0
    """Set by the launching process: the world rank of the first dedicated parameter server (the
    trainers' count; 0: none), so that a failure report names servers as such."""
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    """host:port of the rendezvous (node 0's address for the static backend)."""
    rdzv_backend: str = "static"
    """'static' (fixed node ranks) or 'c10d' (elastic; node ranks assigned at rendezvous)."""
    rdzv_id: str = "paratrain"
    device: str = "auto"
    """'cpu' (gloo), 'cuda' (NCCL, one GPU per process) or 'auto': CUDA when this node sees a GPU. On
    CUDA the default nproc is the number of visible GPUs, and more processes than GPUs are refused."""
    replica_group: int = -1
    """Under parallel.fault_tolerance 'replica': the replica group this launcher runs (set by the top launcher for
    each group it starts; given by hand to start a lost group again, with lighthouse); -1: the top launcher."""
    lighthouse: str = ""
    """Under fault tolerance: HOST:PORT of the store the replica groups meet at (the top launcher's; it prints it)."""
    max_restarts: int = 0
    """Launch the job again this many times when a rank fails; it resumes from the newest
    checkpoint under train.save that verifies (so train.save is needed)."""
    min_nodes: int = 0
    """With max_restarts and the c10d rendezvous: a relaunch may go on with as few as this many nodes
    when some do not come back (0: all nnodes, always). dp is recomputed from the nodes that meet and
    the global batch is kept (accumulation grows); every node count from min_nodes to nnodes is
    checked before launch."""
    flight_dir: str = ""
    """Set by the launcher (--flight-dir): where each worker leaves its flight recorder (its last
    collectives) and its stack when it fails or is stopped, for the launcher's hang report."""
    attempt: int = 0
    """Set by the launcher on a relaunch (--attempt K): 0 the first time; above, resume from the newest
    verified checkpoint under train.save, and the JSON log keeps each step once."""
    memory_check: bool = True
    """Refuse before launch a layout the planner predicts will not fit the device's memory (GPU) or
    this node's available memory shared by its processes (CPU)."""
    plan: str = ""
    """'auto': the planner chooses dp, tp, pp, ZeRO, micro-batch, recompute and sequence parallelism
    for the processes at hand (paratrain.planner.auto); axes given as flags are kept. '': as given."""
    timeout_s: float = 300.0
    """How long a collective may wait before the job fails naming the group and operation."""


@dataclass
class RunConfig:
    seed: int = 1234
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    launch: LaunchSection = field(default_factory=LaunchSection)
