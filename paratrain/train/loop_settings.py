"""What a TrainLoop is told (LoopSettings: the run's length, schedule, logging, validation and checkpoints) and
what it gives back (LoopResult)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoopSettings:
    steps: int
    """Optimizer steps of the whole run (a resumed run goes on to the same number)."""
    lr: float
    """The peak learning rate."""
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0
    """The schedule ends at lr x this at the last step; 1.0: constant."""
    lr_schedule: str = "cosine"
    """After warmup (paratrain.train.schedule): cosine, wsd, linear or constant."""
    decay_fraction: float = 0.2
    """wsd: the share of the steps spent decaying."""
    log_every: int = 1
    """Read the values back every this many steps (the steps between wait for nothing)."""
    eval_every: int = 0
    """Validate every this many steps (and at step 0 and the last step, when there is validation data)."""
    eval_batches: int = 0
    """Global batches per validation; 0: the whole validation set."""
    save: str = ""
    """Folder for sharded checkpoints ('' none), written every save_every steps and at the last one."""
    save_every: int = 0
    keep_last: int = 0
    """Keep the newest this many checkpoints (0: all)."""
    save_mode: str = "sync"
    """'async': paratrain.checkpoint.async_save (the step waits for a copy, a writer process writes)."""
    memory_copies: int = 0
    """With 'async': each rank's copies also kept by the launchers of this many other nodes
    (paratrain.checkpoint.memory_copies)."""
    nan_skips: int = 10
    """Under the engine's on_non_finite='skip': the most non-finite steps skipped before the run stops."""
    check_collectives: bool = False
    """Compare the ranks' sequences of collectives after every step (always after the first)."""
    log_json: str = ""
    tensorboard: str = ""
    loggers: tuple[str, ...] = ()
    """Weights & Biases and MLflow ('wandb', 'mlflow'; paratrain.train.loggers), writing under log_dir."""
    log_dir: str = ""
    progress: bool = False
    """A progress bar on rank 0."""
    flops_per_token: float | None = None
    """Model FLOPs per token, for MFU in the records (None: no MFU)."""
    checkpoint_meta: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_files: Mapping[str, str] = field(default_factory=dict)
    """Files each checkpoint carries, name inside it -> source (paratrain.checkpoint.sharded.save_sharded's
    attachments: an --hf run's model configuration and tokenizer)."""
    """Kept in every checkpoint's meta.json beside the loader's cursor (the run's config, who wrote it)."""
    attempt: int = 0
    """How many times the launcher relaunched the job (above 0 the JSON log keeps each step once)."""


@dataclass
class LoopResult:
    losses: dict[int, float] = field(default_factory=dict)
    """Global-batch training loss by step (1-based: the loss of the step that made step N)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss by step (0: before training)."""
    wall_s: float = 0.0
    """Seconds from the first step to the end of the last, on this rank."""
    steady_tokens: int = 0
    """Tokens of the global batches after this run's first step (whose time holds compilation and allocation)."""
    steady_s: float = 0.0
    """Their steps' time (validation and checkpoints left out, as in each step's record)."""
    mfu: float | None = None
    """Model FLOPs utilisation over those steps, where the device's peak is known (CUDA)."""

    @property
    def tokens_per_s(self) -> float | None:
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else None
