"""What a checked run resolves to (RunPlan: the model, the layout against a world size, the batch
cut), and the run file the launcher hands its workers: the RunConfig as JSON, after --plan auto."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paratrain.config.errors import ConfigError
from paratrain.config.load import from_dict, to_dict
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig
from paratrain.config.rules import divisors
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
        choices = divisors(per_rank)
        raise ConfigError(
            f"accumulation = global_batch / (micro_batch x dp) = {global_batch} / ({micro} x {dp}) "
            f"= {global_batch / (micro * dp):g} is not an integer: choose micro_batch in {choices}, "
            f"or global_batch a multiple of {micro * dp}"
        )
    return BatchLayout(global_batch=global_batch, micro_batch=micro, dp=dp)


@dataclass(frozen=True)
class RunPlan:
    """A RunConfig checked and resolved: what the workers build."""

    config: RunConfig
    model: ModelConfig
    parallel: ParallelConfig
    batch: BatchLayout
    seq_len: int


def write_run(config: RunConfig, path: str | Path) -> Path:
    """Write the run (every setting, the planner's choice included) where the workers read it: each
    builds its RunPlan from this file against the world it meets (check_run), parsing no flags."""
    path = Path(path)
    path.write_text(json.dumps(to_dict(config), indent=1) + "\n")
    return path


def read_run(path: str | Path) -> RunConfig:
    """The RunConfig of a file written by write_run."""
    try:
        table = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"run file {str(path)!r} does not exist: the launcher writes it before it starts the "
                          "workers (paratrain train)") from None
    except ValueError as error:
        raise ConfigError(f"run file {str(path)!r} is not valid JSON: {error}") from None
    return from_dict(table)


@dataclass(frozen=True)
class BatchRampup:
    """Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch starts at `start` samples and grows by
    `increment` every SAMPLES / ((target - start) / increment) samples consumed, up to `target` (the run's global
    batch). Which samples a run reads is unchanged (the same global order, consumed in order); only how many make a
    step."""

    start: int
    increment: int
    samples: int
    target: int

    @classmethod
    def parse(cls, text: str, target: int) -> BatchRampup:
        """'START,INCREMENT,SAMPLES' (ValueError naming the rule when it breaks one)."""
        try:
            start, increment, samples = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a batch ramp-up is START,INCREMENT,SAMPLES (three integers, e.g. 32,32,1000000), got "
                             f"{text!r}") from None
        if start < 1 or increment < 1 or samples < 1:
            raise ValueError(f"batch ramp-up {text!r}: START, INCREMENT and SAMPLES must be >= 1")
        if start >= target or (target - start) % increment:
            raise ValueError(f"batch ramp-up {text!r}: the global batch {target} must be START ({start}) plus a "
                             f"whole number of INCREMENTs ({increment}), START below it")
        return cls(start, increment, samples, target)

    def batch_at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        per_increment = self.samples / ((self.target - self.start) // self.increment)
        return min(self.target, self.start + int(consumed // per_increment) * self.increment)

    def sizes(self) -> list[int]:
        """Every global batch size the ramp-up passes through, the target's included."""
        return list(range(self.start, self.target + 1, self.increment))


@dataclass(frozen=True)
class SeqWarmup:
    """Sequence-length warm-up, 'START,STEPS': each sample of S tokens is read as S / L sequences of L tokens (the
    same tokens and targets; each piece attends within itself), L doubling from START to S in equal shares of the
    first STEPS steps, S from then on. Which samples a step reads is unchanged; its micro-batches multiply by S / L
    (the micro-batch keeps its rows, of shorter sequences)."""

    start: int
    steps: int
    seq_len: int

    @classmethod
    def parse(cls, text: str, seq_len: int) -> SeqWarmup:
        """'START,STEPS' (ValueError naming the rule when it breaks one)."""
        try:
            start, steps = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"a sequence warm-up is START,STEPS (two integers, e.g. 256,2000), got {text!r}") from None
        if start < 2 or steps < 1:
            raise ValueError(f"sequence warm-up {text!r}: START must be >= 2 and STEPS >= 1")
        ratio = seq_len // start
        if start >= seq_len or seq_len % start or ratio & (ratio - 1):
            raise ValueError(f"sequence warm-up {text!r}: the sequence length {seq_len} must be START ({start}) times "
                             "a power of two, START below it")
        return cls(start, steps, seq_len)

    def length_at(self, step: int) -> int:
        """The sequence length of step `step` (0-based)."""
        doublings = (self.seq_len // self.start).bit_length() - 1
        if step >= self.steps:
            return self.seq_len
        return self.start << min(doublings, step * (doublings + 1) // self.steps)

    def lengths(self) -> list[int]:
        """Every sequence length it passes through, the full one included."""
        return sorted({self.length_at(s) for s in range(self.steps + 1)})
