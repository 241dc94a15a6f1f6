"""Trainer: the training loop of a run plan, on one rank of the job.

Builds the model (layout-free init), the engine (parallelize), the loaders, then per step: read
this rank's rows of the global batch, train_step, set the learning rate, log, validate, checkpoint.
Resuming restores the engine and the loader cursor, so the run continues exactly where it stopped.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint import (SHARDED_FORMAT, checkpoint_to_resume, load_checkpoint, load_sharded,
                                  resolve_checkpoint, save_sharded)
from paratrain.comm.order import check_collective_order
from paratrain.config import ConfigError, RunPlan, to_dict
from paratrain.data import GlobalBatchLoader, TokenSource, load_source
from paratrain.hybrid import Engine, NonFiniteError, StepStats, parallelize
from paratrain.models import GPT, build_gpt, lm_loss
from paratrain.topology import Context
from paratrain.train.log import get_logger
from paratrain.train.metrics import JsonLog, Records, peak_flops, step_record
from paratrain.train.optim import adamw_factory
from paratrain.train.schedule import lr_at
from paratrain.train.tensorboard import TensorBoardLog


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    """Global-batch training loss by step (1-based: the loss of the step that made step N)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    sample: str = ""


def check_data(plan: RunPlan, source: TokenSource) -> None:
    """Rules that need the data: vocabulary fits the model; enough samples for a batch."""
    if source.vocab_size > plan.model.vocab_size:
        raise ConfigError(
            f"the data uses token ids up to {source.vocab_size - 1}, but the model's vocab_size is "
            f"{plan.model.vocab_size}: set model vocab_size >= {source.vocab_size}"
        )
    for split, tokens in (("train", source.train), ("val", source.val)):
        samples = (len(tokens) - 1) // plan.seq_len
        if samples < plan.batch.global_batch:
            raise ConfigError(
                f"the {split} split of {source.name!r} holds {samples} samples of {plan.seq_len + 1} tokens, "
                f"fewer than one global batch ({plan.batch.global_batch}): lower global_batch or seq_len"
            )


class Trainer:
    def __init__(self, plan: RunPlan, ctx: Context) -> None:
        self.plan, self.ctx = plan, ctx
        self.attempt = plan.config.launch.attempt
        """0, or how many times the launcher relaunched the job (it resumes from the newest checkpoint
        under train.save that verifies)."""
        config = plan.config
        self.log = get_logger(ctx.rank)
        self.source = load_source(config.data.source, val_fraction=config.data.val_fraction)
        check_data(plan, self.source)
        # Built on the meta device: parallelize allocates and initialises only this rank's pieces.
        self.model: GPT = build_gpt(plan.model, seed=config.seed, device="meta")
        self.engine: Engine = parallelize(
            self.model, ctx, optimizer=adamw_factory(self.model, config.optim),
            micro_batch=plan.batch.micro_batch, precision=config.train.precision,
            grad_clip=config.optim.grad_clip, recompute=config.train.recompute, seed=config.seed,
            on_non_finite="skip" if config.train.nan_policy == "skip" else "raise", compile=config.train.compile,
        )
        self.non_finite_skips = 0
        dp, dp_index = ctx.mesh.degree("dp"), ctx.mesh.index("dp")
        loader_args = dict(seq_len=plan.seq_len, global_batch=plan.batch.global_batch, dp=dp,
                           dp_index=dp_index, seed=config.seed)
        self.train_loader = GlobalBatchLoader(self.source.train, **loader_args)  # type: ignore[arg-type]
        self.val_loader = GlobalBatchLoader(self.source.val, shuffle=False, **loader_args)  # type: ignore[arg-type]
        self.step = 0
        if self.attempt > 0:
            self._resume("auto")
        elif config.train.resume:
            self._resume(config.train.resume)

    def _resume(self, path: str) -> None:
        # verified with the hashing shared out over the ranks, who agree on the verdict
        found = checkpoint_to_resume(path, self.plan.config.train.save)
        if found is None:
            self.log.info("--resume auto: no checkpoint under %s verifies; starting at step 0",
                          self.plan.config.train.save)
            return
        folder, meta = found
        if meta["format"] == SHARDED_FORMAT:  # each rank reads only the pieces its layout keeps
            load_sharded(folder, meta, self.engine)
        else:  # a whole-model checkpoint (format 1, before sharded saves): every rank reads it all
            state, meta = load_checkpoint(folder)
            self.engine.load_state_dict(state)
        self.train_loader.load_state_dict(meta["loader"])
        self.step = int(meta["step"])
        self.log.info("resumed from %s at step %d on world %d (dp %d)", folder, self.step, self.ctx.world_size,
                      self.ctx.mesh.degree("dp"))

    def save(self) -> None:
        root = self.plan.config.train.save
        meta = {"config": to_dict(self.plan.config), "loader": self.train_loader.state_dict()}
        # collective: every rank writes its own pieces; rank 0 publishes the index once all are on disk
        folder = save_sharded(root, self.step, self.engine, meta, keep_last=self.plan.config.train.keep_last,
                              before_publish=self._maybe_fail_saving)
        if self.ctx.is_main:
            self.log.info("saved checkpoint %s", folder)

    def validate(self) -> float:
        self.val_loader.load_state_dict({"epoch": 0, "cursor": 0})
        batches = min(self.plan.config.train.eval_batches or 1, self.val_loader.batches_per_epoch)
        losses = [self.engine.eval_loss(self.val_loader.next(), lm_loss) for _ in range(batches)]
        return sum(losses) / len(losses)

    def fit(self) -> TrainResult:
        config, train = self.plan.config, self.plan.config.train
        result = TrainResult()
        json_log = Records(
            JsonLog(train.log_json if self.ctx.is_main else None, append=self.step > 0,
                    keep_until=(self.step if self.step > 0 else -1) if self.attempt > 0 else None),
            TensorBoardLog(train.tensorboard, resumed_at=self.step) if train.tensorboard and self.ctx.is_main else None)
        flops_per_token = self.plan.model.flops_per_token(self.plan.seq_len)
        peak = peak_flops(self.ctx.device)
        bar = self._progress_bar()
        start_step = self.step
        if self.step == 0:
            # The starting point, so the log shows how far validation loss came down.
            result.val_losses[0] = self.validate()
            json_log.write({"step": 0, "val_loss": result.val_losses[0]})
        # Steps are queued without reading anything back (Engine.step); their values are read at the
        # end of each log interval (or when a step must be looked at: validation, checkpoint, the last
        # one), and the interval's time is spread over its steps.
        unread: list[tuple[int, float, Any]] = []  # (step, lr, PendingStep) since the last read
        interval_start = time.perf_counter()
        try:
            while self.step < train.steps:
                lr = lr_at(self.step, total_steps=train.steps, peak=config.optim.lr,
                           warmup_steps=config.optim.warmup_steps, min_ratio=config.optim.min_lr_ratio)
                self.engine.set_lr(lr)
                self._maybe_fail()
                batch = self.train_loader.next()
                try:
                    pending = self.engine.step(batch, lm_loss)
                except NonFiniteError as error:  # read before the update (--nan-policy skip, fp16)
                    raise self._stopped(error.step, str(error)) from None
                self.step += 1
                if self.step == start_step + 1 or train.check_collectives:  # did every rank issue the same?
                    check_collective_order(self.ctx.mesh, self.ctx.device, keep_checking=train.check_collectives)
                unread.append((self.step, lr, pending))
                last = self.step == train.steps
                validating = bool(train.eval_every and self.step % train.eval_every == 0) or last
                saving = bool(train.save and ((train.save_every and self.step % train.save_every == 0) or last))
                if bar is not None:
                    bar.update(1)
                if not (self.step % train.log_every == 0 or validating or saving or pending.ready
                        or self.step == start_step + 1):
                    continue
                try:  # the first read waits for the device; the interval's other steps are done by then
                    read = [p.stats() for _, _, p in unread]
                except NonFiniteError as error:
                    raise self._stopped(error.step, str(error)) from None
                step_time = (time.perf_counter() - interval_start) / len(unread)
                for (number, step_lr, _), stats in zip(unread, read):
                    result.losses[number] = stats.loss
                    record = self._record(number, step_lr, stats, step_time, flops_per_token, peak)
                    if number == self.step:
                        if validating:
                            record["val_loss"] = result.val_losses[self.step] = self.validate()
                        if self.step % train.log_every == 0 or last or validating:
                            json_log.write(record)
                        if self.step == start_step + 1:  # optimizer state exists now: what this rank holds
                            json_log.write({"step": self.step, "memory": self.memory_record()})
                        if bar is not None:
                            postfix = {"loss": f"{stats.loss:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
                            if "val_loss" in record:
                                postfix["val"] = f"{record['val_loss']:.3f}"
                            bar.set_postfix(postfix, refresh=False)
                unread.clear()
                if saving:
                    self.save()
                interval_start = time.perf_counter()
        finally:
            if bar is not None:
                bar.close()
            json_log.close()
        # Under ZeRO-3 every forward all-gathers parameters, under tp every layer communicates: then
        # all ranks generate (the same text).
        sharded = self.engine.grads.params_sharded or self.engine.tp is not None
        if self.engine.pipeline is not None:  # no rank holds the whole model to sample from
            if train.sample_tokens and self.ctx.is_main:
                self.log.info("no sample under pipeline parallelism (each rank holds only its stage)")
        elif train.sample_tokens and (self.ctx.is_main or sharded) and self.source.vocab_size == 256:
            text = self.sample(train.sample_tokens)
            result.sample = text if self.ctx.is_main else ""
        return result

    def _record(self, step: int, lr: float, stats: StepStats, step_time: float, flops_per_token: float,
                peak: float | None) -> dict[str, Any]:
        """The JSON record of one step (warning once on rank 0 about a skipped update)."""
        train = self.plan.config.train
        record = step_record(step, lr, stats, step_time, world_size=self.ctx.world_size,
                             flops_per_token=flops_per_token, peak=peak)
        if stats.non_finite:  # skipped by --nan-policy skip
            self.non_finite_skips += 1
            if self.non_finite_skips > train.nan_skips:
                raise self._stopped(step, f"{self.non_finite_skips} non-finite steps skipped, more than "
                                          f"train.nan_skips ({train.nan_skips})")
            if self.ctx.is_main:
                self.log.warning("step %d: loss %s, grad norm %s: not finite; update skipped on every rank "
                                 "(%d of at most %d)", step, stats.loss, stats.grad_norm,
                                 self.non_finite_skips, train.nan_skips)
        elif stats.skipped:
            if self.ctx.is_main:  # every rank took the same decision: say it once
                self.log.warning("step %d: fp16 gradients overflowed (loss scale %g); update skipped on "
                                 "every rank", step, stats.loss_scale)
        return record

    def _stopped(self, step: int, why: str) -> FloatingPointError:
        """The error that stops a run at a non-finite step, naming the newest checkpoint to resume from."""
        root = self.plan.config.train.save
        try:
            newest = str(resolve_checkpoint(root)) if root else ""
        except FileNotFoundError:
            newest = ""
        where = (f"newest checkpoint: {newest} (--resume {root})" if newest else
                 "no checkpoint saved yet" + ("" if root else " (--save DIR keeps them)"))
        return FloatingPointError(f"step {step}: {why}; {where}. Lower --lr, clip harder (--grad-clip), or "
                                  "--nan-policy skip to skip such steps")

    def memory_record(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on rank 0 (and CUDA's peak there)."""
        record = self.engine.memory_report()
        if self.ctx.device.type == "cuda":
            record["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return record

    def _maybe_fail_saving(self) -> None:
        """'RANK:STEP:kill-saving': SIGKILL while saving step STEP, this rank's file written, the
        checkpoint not yet published."""
        if self.plan.config.train.fail_at and self.attempt == 0:
            rank, step, *how = self.plan.config.train.fail_at.split(":")
            if how == ["kill-saving"] and int(rank) == self.ctx.rank and int(step) == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_fail(self) -> None:
        if self.plan.config.train.fail_at:
            rank, step, *how = self.plan.config.train.fail_at.split(":")
            if how == ["kill-saving"]:
                return
            if int(rank) == self.ctx.rank and int(step) == self.step + 1 and self.attempt == 0:
                if how == ["kill"]:  # as the out-of-memory killer or `kill -9` would
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == ["kill-node"]:  # a node lost whole: its launcher, its other workers, this one
                    _kill_node()
                while how == ["hang"]:  # a rank that stops answering: its peers time out in a collective
                    time.sleep(1.0)
                raise RuntimeError(f"injected fault (train.fail_at) on rank {rank} at step {step}")

    def _progress_bar(self) -> Any:
        if not (self.plan.config.train.progress and self.ctx.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.plan.config.train.steps, initial=self.step, desc="train", unit="step",
                    dynamic_ncols=True, mininterval=0.5)

    def sample(self, length: int, prompt: str = "The ") -> str:
        """Text generated by the trained model from `prompt` (rank 0; a fixed sampling seed)."""
        self.model.eval()
        ids = torch.tensor([self.source.encode_text(prompt)], device=self.ctx.device)
        generator = torch.Generator().manual_seed(self.plan.config.seed)
        split = self.ctx.config.tp if self.ctx.config.sequence_parallel else 1  # equal sequence parts
        out = self.model.generate(ids, length, generator=generator, pad_to=split)
        self.model.train()
        return self.source.decode(out[0].tolist())


def _kill_node() -> None:
    """SIGKILL this worker's launcher (its parent), its sibling workers, then itself (Linux /proc)."""
    launcher = os.getppid()
    victims = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == launcher and int(stat.parent.name) != os.getpid():  # fields[1]: the parent's pid
            victims.append(int(stat.parent.name))
    for pid in [launcher, *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone already, or not ours to kill
            pass
    os.kill(os.getpid(), signal.SIGKILL)
