"""paratrain.Trainer: the training loop in the shape Lightning users know, on paratrain's engine.

    torch.manual_seed(0)
    model = build_my_model()
    trainer = paratrain.Trainer(devices=4, strategy="zero2", max_steps=200, global_batch=64, lr=1e-3)
    result = trainer.fit(model, loss_fn, train_data, val_data)

Lightning's `Trainer(num_nodes, devices, strategy="ddp")` maps onto `Trainer(num_nodes, devices,
strategy)`; the differences that matter (docs/lightning.md): the batch is the *global* batch, cut
over the ranks by a layout-free sample order, so the same seed gives the same per-step losses for
any `devices` and strategy; and `loss_fn(model, batch)` returns the loss of its batch, as a mean over
the batch's samples or as (sum of per-sample losses, count).

Processes. Run as a plain script (`python train.py`) with devices x num_nodes > 1, fit launches that
many worker processes that run the same script again (torch's elastic launcher, as torchrun): each
builds the same model, reaches fit, and trains its part. When they are done, the launching process
loads the trained weights into `model` and returns rank 0's FitResult; the workers leave at the end
of fit, so the code after fit runs once, in the launching process. Under an external launcher
(torchrun, SLURM's srun through torchrun), fit trains on the process it is called in and returns there,
on every rank; `trainer.engine` then holds this rank's part of the model (`trainer.engine.state_dict()`
gathers it whole). (The launching side: paratrain.fit.launcher; strategy names: paratrain.fit.strategy.)
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from paratrain.config import ConfigError, ParallelConfig
from paratrain.config.run import LR_SCHEDULES, OPTIMIZERS, LaunchSection, OptimSection
from paratrain.config.validate import DEVICES, batch_layout, check_save_mode
from paratrain.config.rules import check_diloco_uses
from paratrain.data_parallel import BATCH_NORM_MODES
from paratrain.data.stream import Data, dataset_loader, is_stream
from paratrain.fit.callbacks import Callback, CallbackHooks
from paratrain.fit.launcher import hand_over, launch_workers, launched_by_trainer, relaunch_attempt
from paratrain.fit.replicas import check_replica_groups, check_replica_uses, launch_replica_groups, quorum_for
from paratrain.fit.result import FitResult
from paratrain.fit.strategy import strategy_config
from paratrain.hybrid import Engine, EngineOptions, parallelize
from paratrain.hybrid.batches import Batch, batch_rows
from paratrain.hybrid.parallelize import OptimizerFactory
from paratrain.memory import PRECISIONS, Float8Settings
from paratrain.nn.recipe import Layer, PipelineLoss, Recipe, recipe_for
from paratrain.topology import Context, join, lay_out
from paratrain.train.loop import TrainLoop, start_loop
from paratrain.train.loop_settings import LoopSettings
from paratrain.train.optim import optimizer_factory

UserLoss = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]"]


class Trainer:
    def __init__(self, *, devices: int = 1, num_nodes: int = 1, strategy: str | ParallelConfig = "ddp",
                 tp: int | None = None, pp: int | None = None, max_steps: int, global_batch: int,
                 micro_batch: int | None = None, lr: float = 1e-3, lr_schedule: str = "constant",
                 warmup_steps: int = 0, min_lr_ratio: float = 0.1, weight_decay: float = 0.0,
                 optimizer: OptimizerFactory | str | None = None, grad_clip: float = 0.0, precision: str = "fp32",
                 fp8: Float8Settings | None = None, recompute: bool | str = False, seed: int = 0, val_every: int = 0,
                 val_batches: int = 0, save: str | None = None, save_every: int = 0, keep_last: int = 0,
                 save_mode: str = "sync", resume: str | None = None, log_json: str | None = None, tensorboard: str | None = None,
                 callbacks: Sequence[Callback] = (), accelerator: str = "cpu", tp_plan: Mapping[str, str] | None = None,
                 pipeline_loss: PipelineLoss | None = None, wrap: Any = None,
                 layers: Callable[[nn.Module], list[Layer]] | None = None, recipe: Recipe | None = None,
                 batch_norm: str = "sync", buffers: Mapping[str, str] | None = None, nan_policy: str = "stop",
                 nan_skips: int = 10,
                 max_restarts: int = 0, node_rank: int | None = None, master: str | None = None,
                 timeout_s: float = 300.0, hf: str | None = None, fault_tolerance: str = "off",
                 replica_groups: int = 2, replica_group: int | None = None, lighthouse: str = "") -> None:
        """devices: processes per node; num_nodes: nodes (their launchers meet at `master`, host:port,
        default $MASTER_ADDR:$MASTER_PORT, with node_rank default $NODE_RANK, as Lightning reads them).
        strategy: 'ddp', 'zero1' / 'zero2' / 'zero3' ('fsdp' = zero3), 'tp' (tp= devices by default),
            '3d' (tp= and pp= given, dp the rest), or a paratrain.ParallelConfig.
        max_steps, global_batch (samples per optimizer step, whatever the layout), micro_batch (samples
            per forward on one rank; None: its whole share).
        lr: the peak learning rate, set on every parameter group at every step; lr_schedule 'constant',
            'cosine', 'linear' (down to lr x min_lr_ratio at the last step) or 'wsd' (warmup-stable-decay: the last
            20 % of the steps down), after warmup_steps of linear warmup.
        optimizer: a factory params -> torch.optim.Optimizer, or a name: 'adamw' (None: betas 0.9, 0.999, with
            weight_decay on matrices only), 'muon' (Muon on the weight matrices, AdamW on the rest, one lr:
            paratrain.optim; any strategy), 'sgd' (momentum 0.9).
        precision: 'fp32', 'bf16', 'fp16' or 'fp8' (fp8: the blocks' linears in float8, as `fp8` says:
            paratrain.Float8Settings(recipe="rowwise", skip=REGEX); default tensorwise); recompute as parallelize's.
        val_every: validate every this many steps (and at step 0 and the end, when val_data is given);
            val_batches: global batches per validation (0: the whole validation set).
        save: a folder for sharded checkpoints, the CLI's (`paratrain inspect` reads them), written every
            save_every steps (0: at the end only), keeping the newest keep_last (0: all), by save_mode 'sync' or
            'async' (the step waits for a copy; a writer process per rank writes: the CLI's --save-mode); resume: a
            checkpoint folder or root, or 'auto' (the newest under save that verifies, if any).
        log_json: the CLI's per-step JSON records; tensorboard: the same as TensorBoard scalars.
        accelerator: 'cpu' (gloo), 'cuda' (NCCL, one GPU per process) or 'auto'.
        tp_plan, pipeline_loss, wrap, layers: as parallelize's, for tensor / pipeline parallelism and ZeRO-3
            units; recipe: all of them at once (paratrain.nn.recipe; paratrain.models.hf.LLAMA_RECIPE for
            Hugging Face Llama / Mistral), the keywords given replacing its fields.
        batch_norm: 'sync' (BatchNorm statistics over every dp rank's samples: devices=N trains as one
            device with N x the micro-batch; needs one micro-batch per step under dp > 1) or 'local'
            (each rank's own, as DDP: the losses then depend on devices); buffers: buffer name -> 'rank0',
            'sum' or 'mean', how a buffer that forward changes is kept equal over dp (as parallelize's).
        nan_policy: a step whose loss or gradient norm is nan or inf: 'stop' the run (naming the step and the
            newest checkpoint) or 'skip' its update on every rank, at most nan_skips times.
        max_restarts: when a worker fails, launch the job again this many times, resuming from the newest
            checkpoint under save= that verifies (needs save=; a launching Trainer only, not under torchrun).
        hf: a local Hugging Face folder whose model fit trains (fit(train_data=...), no model): each rank reads
            its pieces from the safetensors files (paratrain.hf.from_pretrained; a vocabulary tp does not divide
            padded), its family's recipe and loss unless given; save_pretrained(OUT) then writes the trained
            model back as a folder transformers loads.
        fault_tolerance: 'off', or 'replica': dp cut into replica_groups groups, each launched as a job of its own,
            so that a lost group costs the others a step, not a relaunch (as `paratrain train --fault-tolerance
            replica`; docs/reliability.md); replica_group=G with lighthouse='HOST:PORT' (the address the
            launching process prints) starts group G alone: a lost one, again, joining the running job.
        """
        if devices < 1 or num_nodes < 1:
            raise ConfigError(f"devices and num_nodes must be >= 1, got devices={devices}, num_nodes={num_nodes}")
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {max_steps}")
        if precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
        if isinstance(optimizer, str) and optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer must be a factory or one of {OPTIMIZERS}, got {optimizer!r}")
        if accelerator not in DEVICES:
            raise ConfigError(f"accelerator must be one of {', '.join(DEVICES)}, got {accelerator!r}")
        if resume == "auto" and not save:
            raise ConfigError("resume='auto' takes the newest verified checkpoint under save: give save=")
        if batch_norm not in BATCH_NORM_MODES:
            raise ConfigError(f"batch_norm must be one of {', '.join(BATCH_NORM_MODES)}, got {batch_norm!r}")
        if nan_policy not in ("stop", "skip") or nan_skips < 0:
            raise ConfigError(f"nan_policy must be 'stop' or 'skip' and nan_skips >= 0, got {nan_policy!r}, {nan_skips}")
        if max_restarts < 0 or (max_restarts and not save):
            raise ConfigError(f"max_restarts={max_restarts}: a relaunch resumes from the newest checkpoint under save=, "
                              "so give save= (and save_every= to lose fewer steps), or max_restarts=0")
        self.world_size = devices * num_nodes
        layout = strategy_config(strategy, devices=devices, tp=tp, pp=pp)
        if fault_tolerance != "off":
            layout = dataclasses.replace(layout, fault_tolerance=fault_tolerance, replica_groups=replica_groups)
        self.parallel = layout.resolved(self.world_size)
        if self.parallel.ps_servers:
            raise ConfigError(f"ps_servers={self.parallel.ps_servers}: paratrain.Trainer does not start dedicated "
                              "parameter servers (ranks that run paratrain.serve, not fit); use ps_servers=0 "
                              "(colocated), `paratrain train --ps-servers`, or parallelize + paratrain.serve in your "
                              "script (docs/param_server.md)")
        if optimizer == "muon" and self.parallel.ps_mode != "off":
            raise ConfigError("optimizer='muon' needs each whole matrix, which the parameter server's slices do not "
                              "give: use a strategy without it (zero1/2/3 shard Muon's state) or optimizer='adamw'")
        if self.parallel.dp_mode == "diloco":
            check_diloco_uses(muon=optimizer == "muon")
        self.batch = batch_layout(global_batch, micro_batch or 0, self.parallel.dp or 1)
        if self.parallel.fault_tolerance == "replica":
            check_replica_uses(accelerator=accelerator, max_restarts=max_restarts,
                               diloco_saves=self.parallel.dp_mode == "diloco" and bool(save))
            check_replica_groups(self.parallel, self.batch, num_nodes=num_nodes, replica_group=replica_group,
                                 lighthouse=lighthouse)
        self.replica_group, self.lighthouse = replica_group, lighthouse
        self.devices, self.num_nodes = devices, num_nodes
        self.max_steps, self.lr, self.lr_schedule = max_steps, lr, lr_schedule
        self.warmup_steps, self.min_lr_ratio, self.weight_decay = warmup_steps, min_lr_ratio, weight_decay
        self.optimizer, self.grad_clip, self.precision, self.recompute = optimizer, grad_clip, precision, recompute
        self.fp8 = fp8 or Float8Settings()
        self.seed, self.val_every, self.val_batches = seed, val_every, val_batches
        self.save, self.save_every, self.keep_last, self.resume = save, save_every, keep_last, resume
        check_save_mode(save_mode, self.parallel.ps_mode)
        self.save_mode = save_mode
        self.log_json, self.tensorboard, self.callbacks = log_json, tensorboard, list(callbacks)
        self.accelerator, self.tp_plan, self.pipeline_loss, self.wrap = accelerator, tp_plan, pipeline_loss, wrap
        self.layers, self.recipe, self.batch_norm, self.buffers = layers, recipe, batch_norm, dict(buffers or {})
        self.nan_policy, self.nan_skips, self.max_restarts = nan_policy, nan_skips, max_restarts
        self.node_rank = int(os.environ.get("NODE_RANK", "0")) if node_rank is None else node_rank
        self.master = master or (f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
                                 if "MASTER_ADDR" in os.environ else "")
        if num_nodes > 1 and not self.master:
            raise ConfigError(f"num_nodes={num_nodes}: the nodes' launchers meet at node 0: give master='host:port' "
                              "(or set MASTER_ADDR and MASTER_PORT) and node_rank (or NODE_RANK) on every node")
        self.timeout_s = timeout_s
        self.hf = hf
        if hf:  # the family's rules (heads, widths divisible by tp), before any process starts
            from paratrain.hf.load import stand_in

            stand_in(hf, tp=self.parallel.tp_split, sequence_parallel=self.parallel.sequence_parallel)
        self.ctx: Context | None = None
        self.engine: Engine | None = None
        self.loop: TrainLoop | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 of the job (True before fit has started one)."""
        return self.ctx is None or self.ctx.is_main

    def fit(self, model: nn.Module | None = None, loss_fn: UserLoss | None = None,
            train_data: Data | None = None, val_data: Data | None = None) -> FitResult:
        """Train `model` for max_steps on `train_data` (any map-style dataset: len() and [i], shuffled by the seed;
        or an iterable one, torch.utils.data.IterableDataset, read in its own order: paratrain.data.stream.StreamLoader
        says how it resumes), items stacked by torch's default_collate. loss_fn(model, batch) returns the batch's loss: a scalar
        (taken as the mean over the batch's samples) or (sum of per-sample or per-token losses, count);
        under pp the loss is pipeline_loss on the last stage and loss_fn is not called. With Trainer(hf=DIR):
        no model (the folder's is trained; loss_fn defaults to its family's, over (input_ids, labels[,
        positions]) items)."""
        from paratrain.data_parallel import batch_norms, check_accumulation
        from paratrain.hybrid.steps import check_whole_model, float8_choice
        from paratrain.launch import launched_by_torchrun

        if self.hf and model is not None:
            raise ConfigError(f"Trainer(hf={self.hf!r}) trains the folder's model: call fit(train_data=...) without "
                              "a model, or drop hf= to train the model you built")
        if train_data is None or (not self.hf and (model is None or loss_fn is None)):
            raise ConfigError("fit needs train_data, and a model and a loss_fn unless the Trainer has hf=")
        if model is not None:  # the layout's rules on the model the caller holds, before any process starts
            recipe = recipe_for(model, self.recipe, tp_plan=self.tp_plan, layers=self.layers,
                                pipeline_loss=self.pipeline_loss)
            check_whole_model(model, recipe, tp=self.parallel.tp, pp=self.parallel.pp, buffers=self.buffers)
            if self.precision == "fp8":
                float8_choice(model, recipe, self.fp8, self.parallel)
        if model is not None and self.batch_norm == "sync" and self.parallel.pp == 1:  # (pp: the engine refuses)
            check_accumulation(batch_norms(model), dp=self.parallel.dp or 1, accumulation=self.batch.accumulation,
                               micro_batch=self.batch.micro_batch)
        for name, data in (("train_data", train_data), ("val_data", val_data)):
            if data is not None and not is_stream(data) and len(data) < self.batch.global_batch:
                raise ConfigError(f"{name} holds {len(data)} samples, fewer than one global batch "
                                  f"({self.batch.global_batch}): lower global_batch or give more data")
        groups = self.parallel.replica_groups if self.parallel.fault_tolerance == "replica" else 1
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != self.world_size // groups:
                raise ConfigError(f"this process was launched into a job of {world} processes, and the Trainer asks "
                                  f"for devices x num_nodes = {self.devices} x {self.num_nodes} = {self.world_size}"
                                  + (f" in {groups} replica groups" if groups > 1 else "") + ": make them agree")
            return self._fit_here(model, loss_fn, train_data, val_data)
        if self.world_size == 1:
            return self._fit_here(model, loss_fn, train_data, val_data)
        launch = LaunchSection(nproc=self.devices, nnodes=self.num_nodes, node_rank=self.node_rank,
                               rdzv_endpoint=self.master, device=self.accelerator, timeout_s=self.timeout_s)
        if groups > 1:
            return launch_replica_groups(model, launch, self.parallel, replica_group=self.replica_group,
                                         lighthouse=self.lighthouse, save=self.save,
                                         fit_here=lambda: self._fit_here(model, loss_fn, train_data, val_data))
        return launch_workers(model, launch, max_restarts=self.max_restarts, save=self.save)

    # --- a rank of the job ---

    def _fit_here(self, model: nn.Module | None, loss_fn: UserLoss | None, train_data: Data,
                  val_data: Data | None) -> FitResult:
        from paratrain.launch.worker import threads_per_rank

        if launched_by_trainer():
            torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        timeout = timedelta(seconds=self.timeout_s)
        member = join(self.accelerator, timeout=timeout)
        ctx = self.ctx = lay_out(member, self.parallel, timeout=timeout, replicas=quorum_for(
            member, self.parallel, timeout_s=self.timeout_s, device=self.accelerator))
        dp, dp_index = ctx.mesh.degree("dp"), ctx.mesh.index("dp")
        if ctx.replicas is not None:  # each step's rows come from the quorum: every rank reads the whole global batch
            dp, dp_index = 1, 0
        loader = dataset_loader(train_data, global_batch=self.batch.global_batch, dp=dp, dp_index=dp_index,
                                seed=self.seed)
        val_loader = None if val_data is None else dataset_loader(
            val_data, global_batch=self.batch.global_batch, dp=dp, dp_index=dp_index, seed=self.seed, shuffle=False)
        source, recipe = None, self.recipe
        if self.hf:  # built on the meta device: each rank reads the pieces it keeps
            from paratrain.hf.load import pretrained_for_training

            pretrained = pretrained_for_training(self.hf, self.parallel.tp)
            model, source, recipe = pretrained.model, pretrained.init, recipe or pretrained.recipe
            loss_fn = loss_fn or pretrained.loss
        assert model is not None and loss_fn is not None
        optimizer = self.optimizer if callable(self.optimizer) else optimizer_factory(OptimSection(
            optimizer=self.optimizer or "adamw", lr=self.lr, weight_decay=self.weight_decay, beta1=0.9, beta2=0.999))
        options = EngineOptions(micro_batch=self.batch.micro_batch, precision=self.precision, fp8=self.fp8,
                                grad_clip=self.grad_clip,
                                recompute=self.recompute, seed=self.seed, wrap=self.wrap, batch_norm=self.batch_norm,
                                buffers=self.buffers, on_non_finite="skip" if self.nan_policy == "skip" else "raise")
        recipe = recipe_for(model, recipe, tp_plan=self.tp_plan, layers=self.layers, pipeline_loss=self.pipeline_loss)
        engine = self.engine = parallelize(model, ctx, optimizer=optimizer, options=options, recipe=recipe,
                                           init=source)
        settings = LoopSettings(
            steps=self.max_steps, lr=self.lr, warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio, lr_schedule=self.lr_schedule, eval_every=self.val_every,
            eval_batches=self.val_batches, save=self.save or "", save_every=self.save_every, keep_last=self.keep_last,
            save_mode=self.save_mode, nan_skips=self.nan_skips, log_json=self.log_json or "", tensorboard=self.tensorboard or "",
            checkpoint_meta={"trainer": "paratrain.Trainer"}, attempt=relaunch_attempt())
        self.loop = start_loop(TrainLoop(engine, ctx, _batch_loss(loss_fn), loader, val_loader, settings,
                                         hooks=[CallbackHooks(self, self.callbacks)]), resume=self.resume or "")
        done = self.loop.run()
        result = FitResult(losses=done.losses, val_losses=done.val_losses, wall_s=done.wall_s)
        for callback in self.callbacks:
            callback.on_fit_end(self, result)
        if launched_by_trainer():  # hand the result and the weights over, and leave
            hand_over(engine, result, weights=not self.hf)
        engine.close()  # the parameter servers leave their loop; hooks and groups released
        return result

    def save_pretrained(self, out: str, *, dtype: torch.dtype | None = None,
                        max_shard_size: str | int = "5GB") -> dict[str, Any] | None:
        """Trainer(hf=DIR, save=...): write the newest checkpoint under save= as a Hugging Face folder
        (paratrain.hf.export_pretrained: streamed, sharded, DIR's config and tokenizer; on rank 0, None
        elsewhere). A model you built and passed to fit: the launching process holds it trained, so its own
        save_pretrained (transformers') writes it."""
        if not self.hf or not self.save:
            raise ConfigError("save_pretrained exports the newest checkpoint under save= of a Trainer(hf=DIR, "
                              f"save=...) (this one has hf={self.hf!r}, save={self.save!r}); for a model you built, "
                              "call its own save_pretrained after fit")
        if not self.is_main or self.node_rank != 0:  # one writer: each node's launching process is "main"
            return None
        from paratrain.hf import export_pretrained

        return export_pretrained(self.save, out, source=self.hf, dtype=dtype, max_shard_size=max_shard_size)

    @property
    def step(self) -> int:
        """Optimizer steps done (0 before fit)."""
        return self.loop.step if self.loop is not None else 0


def _batch_loss(loss_fn: UserLoss) -> Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor | int]]:
    """The engine's loss contract from the user's: a scalar is the mean over the batch's samples."""

    def batch_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | int]:
        value = loss_fn(model, batch)
        if isinstance(value, tuple):
            return value
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise TypeError(f"loss_fn(model, batch) must return a scalar tensor (the mean over the batch's samples) "
                            f"or (sum, count), got {type(value).__name__}"
                            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""))
        rows = batch_rows(batch)
        return value * rows, rows

    return batch_loss
