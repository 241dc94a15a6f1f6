"""TrainLoop: the one training loop under both trainers (the CLI's and the Lightning-shaped one).

Per step: set the learning rate, read this rank's rows of the global batch, queue the step
(Engine.step), and at the end of each log interval (or when a step must be looked at: validation, a
checkpoint, the last step) read the interval's values back, write one record per step, validate,
checkpoint. A checkpoint holds the engine and the loader's cursor, so `resume` continues exactly where a
run stopped, on any layout. What differs between the trainers is their setup (which model, which
data, which loss) and the hooks they pass: the CLI's fault injection, the Trainer's user callbacks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from paratrain.checkpoint import (SHARDED_FORMAT, CheckpointError, checkpoint_to_resume, load_checkpoint,
                                  load_sharded, resolve_checkpoint, save_sharded)
from paratrain.checkpoint.async_save import AsyncSaver
from paratrain.checkpoint.memory_copies import MemoryCopies, newest_folder_step
from paratrain.comm.order import check_collective_order
from paratrain.hybrid import Engine, NonFiniteError, StepStats
from paratrain.hybrid.engine import LossFn
from paratrain.topology import Context
from paratrain.train.fault_tolerance import ReplicaSteps
from paratrain.train.log import get_logger
from paratrain.train.loop_settings import LoopResult, LoopSettings
from paratrain.train.metrics import JsonLog, RecordLog, Records, mfu, peak_flops, step_record
from paratrain.train.schedule import lr_at
from paratrain.train.tensorboard import TensorBoardLog


class Loader(Protocol):
    """A layout-free loader (paratrain.data.GlobalBatchLoader, DatasetLoader): this rank's rows of the
    next global batch, and a cursor to save and restore."""

    @property
    def batches_per_epoch(self) -> int: ...
    def next(self) -> Any: ...
    def rewind(self) -> None: ...
    def log_fields(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, int]: ...
    def load_state_dict(self, state: dict[str, int]) -> None: ...


class Hook:
    """Code run at fixed points of the loop, on every rank; each default does nothing."""

    def on_start(self, loop: TrainLoop) -> None:
        """After a checkpoint was resumed, before the first step."""

    def on_step_start(self, loop: TrainLoop) -> None:
        """Before each step (loop.step: the steps done so far)."""

    def on_batch(self, loop: TrainLoop, batch: Any) -> Any:
        """The batch the coming step trains on (this one, or another: fault injection, skipped batches)."""
        return batch

    def on_step_end(self, loop: TrainLoop, record: dict[str, Any]) -> None:
        """After each step's values were read: its record (and val_loss on a validation step)."""

    def on_validation_end(self, loop: TrainLoop, step: int, val_loss: float) -> None:
        """After each validation (step 0: before training)."""

    def before_publish(self, loop: TrainLoop) -> None:
        """While saving, once this rank's files are written and before the checkpoint is published."""

    def on_end(self, loop: TrainLoop, result: LoopResult) -> None:
        """After the last step and its checkpoint."""

    def on_error(self, loop: TrainLoop, error: BaseException) -> None:
        """A step raised `error` (it is raised again after every hook has seen it): write what explains it."""


class TrainLoop:
    def __init__(self, engine: Engine, ctx: Context, loss_fn: LossFn, train: Loader, val: Loader | None,
                 settings: LoopSettings, *, hooks: Sequence[Hook] = ()) -> None:
        self.engine, self.ctx, self.loss_fn = engine, ctx, loss_fn
        self.train, self.val, self.settings = train, val, settings
        self.hooks = list(hooks)
        self.step = 0
        """Optimizer steps done (the next step's number is step + 1)."""
        self.log = get_logger(ctx.rank)
        self.non_finite_skips = 0
        self.saver = AsyncSaver() if settings.save and settings.save_mode == "async" else None
        self.copies = MemoryCopies(settings.memory_copies) if self.saver is not None and settings.memory_copies else None
        """Under memory copies: the keepers this rank's checkpoints also go to, and a relaunch reads first."""
        self.replicas = ReplicaSteps(ctx.replicas) if ctx.replicas is not None else None
        """Under fault tolerance: each step's rows from the quorum, redone when a replica group is lost."""

    # --- checkpoints ---

    def resume(self, path: str) -> bool:
        """Restore the engine and the loader from a checkpoint folder or root, or 'auto' (the newest
        under settings.save that verifies); False when 'auto' finds none. Verified with the hashing
        shared out over the ranks, who agree on the verdict."""
        if path == "auto" and self.copies is not None and self._resume_from_memory():
            return True
        found = checkpoint_to_resume(path, self.settings.save)
        if found is None:
            return False
        folder, meta = found
        if meta["format"] == SHARDED_FORMAT:  # each rank reads only the pieces its layout keeps
            load_sharded(folder, meta, self.engine.view())
        else:  # a whole-model checkpoint (format 1, before sharded saves): every rank reads it all
            state, meta = load_checkpoint(folder)
            self.engine.load_state_dict(state)
        self.train.load_state_dict(meta["loader"])
        self.step = int(meta["step"])
        self.log.info("resumed from %s at step %d on world %d (dp %d)", folder, self.step, self.ctx.world_size,
                      self.ctx.mesh.degree("dp"))
        return True

    def _resume_from_memory(self) -> bool:
        """The memory copies' newest complete step, if none on disk is newer (the folders listed, none read)."""
        assert self.copies is not None
        found = self.copies.newest(at_least=newest_folder_step(self.settings.save))
        if found is None:
            return False
        meta = self.copies.load(*found, self.engine.view())
        self.train.load_state_dict(meta["loader"])
        self.step = int(meta["step"])
        self.log.info("resumed from the memory copies of step %d (on %s; no checkpoint file read) at step %d on "
                      "world %d (dp %d)", self.step, ", ".join(sorted(set(found[1].values()))), self.step,
                      self.ctx.world_size, self.ctx.mesh.degree("dp"))
        return True

    def save(self) -> None:
        """Collective: every rank writes its own pieces; rank 0 publishes the index once all are on disk. Under
        save_mode 'async' the step waits for a copy of them, and a checkpoint that failed in the background is
        said here (the newest published one stays `latest`) and training goes on."""
        meta = {**self.settings.checkpoint_meta, "loader": self.train.state_dict()}
        self.engine.before_save(self.step)  # the parameter servers write their pieces too
        hooks = lambda: [hook.before_publish(self) for hook in self.hooks]  # noqa: E731
        if self.saver is None:
            folder = save_sharded(self.settings.save, self.step, self.engine.view(), meta,
                                  keep_last=self.settings.keep_last, before_publish=hooks,
                                  attachments=self.settings.checkpoint_files)
            if self.ctx.is_main:
                self.log.info("saved checkpoint %s", folder)
            return
        try:
            self.saver.wait()
        except CheckpointError as error:
            self.log.warning("%s", error)
        if self.saver.missed:
            self.log.warning("the memory copies of the last checkpoint did not reach %s (it is on disk)",
                             ", ".join(self.saver.missed))
        folder = self.saver.save(self.settings.save, self.step, self.engine.view(), meta,
                                 keep_last=self.settings.keep_last, before_publish=hooks,
                                 attachments=self.settings.checkpoint_files, copies=self.copies)
        if self.ctx.is_main:
            self.log.info("checkpoint %s copied in %.3f s; its writer publishes it", folder, self.saver.blocked_s)

    # --- the loop ---

    def lr_at(self, step: int) -> float:
        s = self.settings
        return lr_at(step, total_steps=s.steps, peak=s.lr, warmup_steps=s.warmup_steps, min_ratio=s.min_lr_ratio,
                     schedule=s.lr_schedule, decay_fraction=s.decay_fraction)

    def validate(self) -> float:
        """Mean of the global batches' mean losses over the first eval_batches batches (or all)."""
        assert self.val is not None
        self.val.rewind()
        batches = min(self.settings.eval_batches or self.val.batches_per_epoch, self.val.batches_per_epoch)
        losses = [self.engine.eval_loss(self.val.next(), self.loss_fn) for _ in range(batches)]
        value = sum(losses) / len(losses)
        for hook in self.hooks:
            hook.on_validation_end(self, self.step, value)
        return value

    def run(self) -> LoopResult:
        s = self.settings
        result = LoopResult()
        if self.replicas is not None:  # meet the other groups (a group joining a running job gets its state here,
            self.replicas.begin(self)  # before its logs open: they then append, as a resumed run's do)
        logs = Records(
            JsonLog(s.log_json if self.ctx.is_main else None, append=self.step > 0,
                    keep_until=(self.step if self.step > 0 else -1) if self.settings.attempt > 0 else None),
            TensorBoardLog(s.tensorboard, resumed_at=self.step) if s.tensorboard and self.ctx.is_main else None,
            *(self._logger(name) for name in s.loggers if self.ctx.is_main))
        peak = peak_flops(self.ctx.device)
        bar = self._progress_bar()
        start_step = self.step
        for hook in self.hooks:
            hook.on_start(self)
        if self.step == 0 and self.val is not None:  # the starting point: how far validation comes down
            result.val_losses[0] = self.validate()
            logs.write({"step": 0, "val_loss": result.val_losses[0]})
        # Steps are queued without reading anything back (Engine.step); their values are read at the
        # end of each log interval (or when a step must be looked at), and the interval's time is
        # spread over its steps.
        unread: list[tuple[int, float, Any]] = []  # (step, lr, PendingStep) since the last read
        started = interval_start = time.perf_counter()
        try:
            while self.step < s.steps:
                lr = self.lr_at(self.step)
                self.engine.set_lr(lr)
                for hook in self.hooks:
                    hook.on_step_start(self)
                if self.replicas is not None:  # joiners admitted, and sent the state, before this step's batch
                    self.replicas.boundary(self)
                batch = self.train.next()
                for hook in self.hooks:
                    batch = hook.on_batch(self, batch)
                try:
                    pending = (self.engine.step(batch, self.loss_fn) if self.replicas is None
                               else self.replicas.step(self, batch))
                except NonFiniteError as error:  # read before the update (on_non_finite='skip', fp16)
                    raise self._stopped(error.step, str(error)) from None
                self.step += 1
                if self.step == start_step + 1 or s.check_collectives:  # did every rank issue the same?
                    check_collective_order(self.ctx.mesh, self.ctx.device, keep_checking=s.check_collectives)
                unread.append((self.step, lr, pending))
                last = self.step == s.steps
                validating = self.val is not None and (bool(s.eval_every and self.step % s.eval_every == 0) or last)
                saving = bool(s.save and ((s.save_every and self.step % s.save_every == 0) or last)
                              and (self.replicas is None or self.replicas.saves()))
                if bar is not None:
                    bar.update(1)
                if not (self.step % s.log_every == 0 or validating or saving or pending.ready
                        or self.step == start_step + 1):
                    continue
                try:  # the first read waits for the device; the interval's other steps are done by then
                    read = [p.stats() for _, _, p in unread]
                except NonFiniteError as error:
                    raise self._stopped(error.step, str(error)) from None
                step_time = (time.perf_counter() - interval_start) / len(unread)
                for (number, step_lr, _), stats in zip(unread, read):
                    result.losses[number] = stats.loss
                    if number > start_step + 1:
                        result.steady_tokens += stats.tokens
                        result.steady_s += step_time
                    record = self._record(number, step_lr, stats, step_time, peak)
                    if number == self.step:
                        record.update(self.train.log_fields())  # the loader's state is this step's
                        if validating:
                            record["val_loss"] = result.val_losses[self.step] = self.validate()
                        if self.step % s.log_every == 0 or last or validating:
                            logs.write(record)
                        if self.step == start_step + 1:  # optimizer state exists now: what this rank holds
                            logs.write({"step": self.step, "memory": self.memory_record()})
                        if bar is not None:
                            postfix = {"loss": f"{stats.loss:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
                            if "val_loss" in record:
                                postfix["val"] = f"{record['val_loss']:.3f}"
                            bar.set_postfix(postfix, refresh=False)
                    for hook in self.hooks:
                        hook.on_step_end(self, record)
                unread.clear()
                if saving:
                    self.save()
                interval_start = time.perf_counter()
            result.wall_s = time.perf_counter() - started
            if self.replicas is not None:  # a group still waiting to join is told the run is over
                self.replicas.end()
            if result.tokens_per_s and self.settings.flops_per_token:
                result.mfu = mfu(result.tokens_per_s, self.settings.flops_per_token, self._counted_ranks, peak)
        except BaseException as error:
            if self.saver is not None:  # a save in flight is given up (the previous one stays `latest`)
                self.saver.abort()
            for hook in self.hooks:
                hook.on_error(self, error)
            raise
        finally:
            if bar is not None:
                bar.close()
            logs.close()
        if self.saver is not None:  # the last checkpoint written and published before the run returns
            self.saver.close()
        for hook in self.hooks:
            hook.on_end(self, result)
        return result

    def _logger(self, name: str) -> RecordLog:
        """Weights & Biases or MLflow, writing under settings.log_dir, the run's config given once."""
        from paratrain.train.loggers import MlflowLog, WandbLog

        config = self.settings.checkpoint_meta.get("config", {})
        return (WandbLog if name == "wandb" else MlflowLog)(self.settings.log_dir, config)

    @property
    def _counted_ranks(self) -> int:
        """The ranks whose tokens a step's statistics count: the world, or under DiLoCo one replica group's (each
        group's statistics are its own: the logs are rank 0's group's), or under fault tolerance every live group's
        (this world is one group; the statistics are the quorum's)."""
        dims = self.ctx.mesh.dims
        if self.ctx.replicas is not None:
            return self.ctx.world_size * len(self.ctx.replicas.epoch.members)
        return self.ctx.world_size // dims.dp_replicate if dims.dp_local else self.ctx.world_size

    def _record(self, step: int, lr: float, stats: StepStats, step_time: float, peak: float | None) -> dict[str, Any]:
        """The JSON record of one step (warning once on rank 0 about a skipped update)."""
        record = step_record(step, lr, stats, step_time, world_size=self._counted_ranks,
                             flops_per_token=self.settings.flops_per_token, peak=peak)
        if stats.non_finite:  # skipped by on_non_finite='skip'
            self.non_finite_skips += 1
            if self.non_finite_skips > self.settings.nan_skips:
                raise self._stopped(step, f"{self.non_finite_skips} non-finite steps skipped, more than "
                                          f"train.nan_skips ({self.settings.nan_skips})")
            if self.ctx.is_main:
                self.log.warning("step %d: loss %s, grad norm %s: not finite; update skipped on every rank "
                                 "(%d of at most %d)", step, stats.loss, stats.grad_norm,
                                 self.non_finite_skips, self.settings.nan_skips)
        elif stats.skipped:
            if self.ctx.is_main:  # every rank took the same decision: say it once
                self.log.warning("step %d: fp16 gradients overflowed (loss scale %g); update skipped on "
                                 "every rank", step, stats.loss_scale)
        return record

    def _stopped(self, step: int, why: str) -> FloatingPointError:
        """The error that stops a run at a non-finite step, naming the newest checkpoint to resume from."""
        root = self.settings.save
        try:
            newest = str(resolve_checkpoint(root)) if root else ""
        except FileNotFoundError:
            newest = ""
        where = (f"newest checkpoint: {newest} (--resume {root})" if newest else
                 "no checkpoint saved yet" + ("" if root else " (--save DIR keeps them)"))
        return FloatingPointError(f"step {step}: {why}; {where}. Lower --lr, clip harder (--grad-clip), or "
                                  "--nan-policy skip to skip such steps")

    def memory_record(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on this rank (and CUDA's peak there)."""
        record = self.engine.memory_report()
        if self.ctx.device.type == "cuda":
            record["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return record

    def _progress_bar(self) -> Any:
        if not (self.settings.progress and self.ctx.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.settings.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                    mininterval=0.5)


def start_loop(loop: TrainLoop, *, resume: str) -> TrainLoop:
    """`loop`, resumed as both trainers resume: from `resume` (a checkpoint folder or root, or 'auto'), or from the
    newest checkpoint under its save folder that verifies once the launcher relaunched the job (settings.attempt >
    0); 'auto' finding none starts at step 0, and says so."""
    resume = "auto" if loop.settings.attempt > 0 else resume
    if resume and not loop.resume(resume):
        loop.log.info("resume auto: no checkpoint under %s verifies; starting at step 0", loop.settings.save or "--save")
    return loop
