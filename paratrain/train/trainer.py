"""Trainer: the CLI's run plan on one rank of the job.

Builds the model (layout-free init), the engine (parallelize), the loaders, and hands them to the
training loop shared with paratrain.Trainer (paratrain.train.loop: learning rate, steps, logs,
validation, checkpoints, resume); at the end, a text sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from paratrain.config import ConfigError, RunPlan, to_dict
from paratrain.config.plan import BatchRampup, SeqWarmup
from paratrain.config.validate import check_loggers
from paratrain.data import GlobalBatchLoader, MixtureLoader, RunData, Source, TokenSource, WeightSchedule, open_data
from paratrain.hybrid import Engine, EngineOptions, parallelize
from paratrain.memory import Float8Settings
from paratrain.models import build_gpt, lm_loss
from paratrain.topology import Context
from paratrain.train.faults import FaultInjection
from paratrain.train.log import get_logger
from paratrain.train.loop import Hook, TrainLoop, start_loop
from paratrain.train.loop_settings import LoopSettings
from paratrain.train.optim import optimizer_factory


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    """Global-batch training loss by step (1-based: the loss of the step that made step N)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    sample: str = ""
    tokens_per_s: float | None = None
    """Global-batch tokens a second over the steps after the first (LoopResult.tokens_per_s)."""
    mfu: float | None = None


def run_hooks(plan: RunPlan, rank: int, attempt: int) -> list[Hook]:
    """The loop hooks the run's train section asks for: fault injection, the spike policy or skipped batches, replica
    checks, straggler detection, profiling (in that order: an injected slowness or batch comes before the tools that
    watch for it). The memory snapshot, which reads the planner's prediction, is the launched worker's to add
    (paratrain.launch.worker)."""
    from paratrain.config.validate import skipped_batches
    from paratrain.train.faults import Injection, SkipBatches, injections
    from paratrain.train.profile import StepProfiler
    from paratrain.train.replicas import ReplicaCheck
    from paratrain.train.spikes import SpikePolicy
    from paratrain.train.stragglers import StragglerWatch

    train = plan.config.train
    hooks: list[Hook] = [FaultInjection(train.fail_at, rank=rank, attempt=attempt)] if train.fail_at else []
    faults: list[Injection] = injections(train.inject, rank=rank)
    hooks += faults
    if train.spike_policy != "off":  # it reads the batches to skip too (and adds the ones that spike)
        hooks.append(SpikePolicy(train.spike_policy, sigma=train.spike_sigma, window=train.spike_window,
                                 skipped=skipped_batches(train.skip_batches)))
    elif train.skip_batches:
        hooks.append(SkipBatches(skipped_batches(train.skip_batches)))
    if train.check_replicas:
        hooks.append(ReplicaCheck(train.check_replicas))
    if train.straggler_factor:
        hooks.append(StragglerWatch(train.straggler_factor, train.straggler_steps))
    if train.profile:
        hooks.append(StepProfiler(train.profile, train.profile_dir))
    return hooks


def check_data(plan: RunPlan, data: RunData) -> None:
    """Rules that need the data, for each source: vocabulary fits the model (and, for --hf, the token files were
    written by the model's own tokenizer when both say which); a mixture's sources written by one tokenizer; enough
    samples for a batch (a mixture's sources together)."""
    for source in data.sources:
        check_source(plan, source)
    if data.weights is not None and any(s.train_mask is not None for s in data.sources):
        raise ConfigError("chat data (a folder `paratrain tokenize --chat` wrote, with loss masks) in a mixture "
                          "(--data-path) is not built: train on it alone with --data")
    recorded = {s.tokenizer["sha256"] for s in data.sources if s.tokenizer is not None}
    if len(recorded) > 1:
        names = ", ".join(s.name for s in data.sources)
        raise ConfigError(f"the mixture's sources were not all written by one tokenizer ({names}: {len(recorded)} "
                          "tokenizers recorded): tokenize them with the same one")
    for split in ("train", "val"):
        sizes = [(len(getattr(s, split)) - 1) // plan.seq_len for s in data.sources]
        if sum(sizes) < plan.batch.global_batch:
            raise ConfigError(
                f"the {split} split of {' + '.join(s.name for s in data.sources)} holds {sum(sizes)} samples of "
                f"{plan.seq_len + 1} tokens, fewer than one global batch ({plan.batch.global_batch}): lower "
                "global_batch or seq_len")
        empty = [s.name for s, n in zip(data.sources, sizes) if n < 1]
        if empty:
            raise ConfigError(f"the {split} split of {empty} holds no sample of {plan.seq_len + 1} tokens: drop them "
                              "from the mixture or lower seq_len")


def check_source(plan: RunPlan, source: TokenSource) -> None:
    """check_data's rules for one source."""
    hf = plan.config.model.hf
    if hf:
        check_hf_tokens(source, hf)
    if source.vocab_size > plan.model.vocab_size:
        raise ConfigError(
            f"the data uses token ids up to {source.vocab_size - 1}, but the model's vocab_size is "
            f"{plan.model.vocab_size}: set model vocab_size >= {source.vocab_size} (--vocab-size, or [model] vocab_size)"
        )
    documents = plan.config.data.documents
    if documents not in ("auto", "on", "off"):
        raise ConfigError(f"data documents is {documents!r}: use 'on', 'off' or 'auto' (--documents)")
    if documents == "on" and source.train_documents is None:
        raise ConfigError(f"document masking (--documents on) needs a document index, and {source.name!r} has none: "
                          "tokenize the corpus with `paratrain tokenize` (or use Megatron's .bin/.idx), or --documents off")


def check_hf_tokens(source: TokenSource, hf: str) -> None:
    """Refuse data whose ids cannot be the HF model's tokenizer's: text read as bytes (paratrain.data.text
    tokenizes it instead), token files another tokenizer wrote, or ids past the tokenizer's vocabulary."""
    from paratrain.data.text import TEXT_SUFFIXES
    from paratrain.data.tokenize import check_tokenizer, load_tokenizer

    if source.name == "builtin" or Path(source.name).is_file():  # a file read as UTF-8 bytes
        raise ConfigError(f"the data {source.name!r} is read as UTF-8 bytes (ids 0-255, the byte-level GPT's), which "
                          f"mean nothing to the model in {hf}: `paratrain train --hf` tokenizes text files "
                          f"({', '.join(TEXT_SUFFIXES)}) and builtin with the model's tokenizer "
                          "(paratrain.data.text); for other files give token files written with it")
    if not (Path(hf) / "tokenizer.json").is_file():
        return  # no tokenizer beside the model: nothing to check the ids against
    if source.tokenizer is not None:
        check_tokenizer(source.name, hf)
        return
    vocab = load_tokenizer(hf)[0].get_vocab_size(with_added_tokens=True)
    if np.issubdtype(source.train.dtype, np.integer) and np.iinfo(source.train.dtype).max < vocab - 1:
        raise ConfigError(f"the token files in {source.name!r} hold {source.train.dtype} ids, which cannot hold "
                          f"{hf}'s vocabulary ({vocab} entries): they were made with another tokenizer; tokenize the "
                          f"corpus again with `paratrain tokenize --tokenizer {hf}` (int32 ids past 65,535 entries)")
    if source.vocab_size > vocab:
        raise ConfigError(f"the token files in {source.name!r} hold ids up to {source.vocab_size - 1}, which "
                          f"{hf}'s tokenizer ({vocab} entries) never writes: they were made with another tokenizer; "
                          f"tokenize the corpus with `paratrain tokenize --tokenizer {hf}`")


def uses_documents(plan: RunPlan, data: RunData) -> bool:
    """Whether the run masks documents (DataSection.documents; check_data refused what cannot be). 'auto' reads the
    model and the data, never the layout: the same command trains alike on one process and on many."""
    documents = plan.config.data.documents
    indexed = all(source.train_documents is not None for source in data.sources)
    return documents == "on" or (documents == "auto" and indexed and bool(plan.config.model.hf))


def loaders(plan: RunPlan, data: RunData, *, dp: int, dp_index: int
            ) -> tuple[GlobalBatchLoader | MixtureLoader, GlobalBatchLoader | MixtureLoader]:
    """The train and validation loaders of the run's data, dp_index's share of dp: one source's windows, or a
    mixture's (paratrain.data.mixture; validation mixes the sources' validation parts by the weights of step 0). The
    plan gives the windows, the seed and the documents (uses_documents); its --batch-rampup grows the training
    loader's global batch to the plan's, its --seq-warmup grows its sequences to seq_len (validation reads whole
    global batches of whole sequences)."""
    config, seq_len, global_batch = plan.config, plan.seq_len, plan.batch.global_batch
    documents = uses_documents(plan, data)
    rampup = BatchRampup.parse(config.data.batch_rampup, global_batch) if config.data.batch_rampup else None
    warmup = SeqWarmup.parse(config.data.seq_warmup, seq_len) if config.data.seq_warmup else None
    args = dict(seq_len=seq_len, global_batch=global_batch, dp=dp, dp_index=dp_index, seed=config.seed)
    if data.weights is None:
        source = data.first
        return (GlobalBatchLoader(source.train, **args, document_starts=source.train_documents if documents else None,
                                  rampup=rampup, loss_mask=source.train_mask, warmup=warmup, order=source.order),
                GlobalBatchLoader(source.val, shuffle=False, **args,
                                  document_starts=source.val_documents if documents else None,
                                  loss_mask=source.val_mask))
    parts = {split: [Source(s.name, getattr(s, split), getattr(s, f"{split}_documents") if documents else None,
                            order=s.order) for s in data.sources] for split in ("train", "val")}
    first = WeightSchedule.of([(0, data.weights.at(0))], len(data.sources))
    return (MixtureLoader(parts["train"], data.weights, **args),
            MixtureLoader(parts["val"], first, shuffle=False, **args))


def job_rank(ctx: Context) -> int:
    """This rank's number in the whole job (under fault tolerance: its replica group's ranks come after the groups
    before it), as --fail-at names ranks."""
    return ctx.rank if ctx.replicas is None else ctx.replicas.group * ctx.world_size + ctx.rank


class Trainer:
    """The CLI's run on one rank: the GPT and its byte- or token-level data set up from the run plan,
    then the shared TrainLoop (paratrain.train.loop), then a text sample."""

    def __init__(self, plan: RunPlan, ctx: Context, *, hooks: Sequence[Hook] = ()) -> None:
        """hooks: run by the loop beside the run's own (fault injection), e.g. paratrain.train.replay's probe."""
        self.plan, self.ctx = plan, ctx
        self.attempt = plan.config.launch.attempt
        """0, or how many times the launcher relaunched the job (it resumes from the newest checkpoint
        under train.save that verifies)."""
        config, train = plan.config, plan.config.train
        self.log = get_logger(ctx.rank)
        data = open_data(config.data.source, path=config.data.path, schedule=config.data.schedule,
                         val_fraction=config.data.val_fraction, split=config.data.split)
        check_data(plan, data)
        self.source = data.first  # decodes samples (a mixture's sources share one tokenizer)
        # Built on the meta device: parallelize allocates and fills only this rank's pieces (keyed init, or
        # with --hf the rows of the folder's safetensors files its pieces need).
        loss_fn, source, recipe = lm_loss, None, None
        if config.model.hf:
            from paratrain.hf.load import pretrained_for_training

            pretrained = pretrained_for_training(config.model.hf, config.parallel.tp)
            self.model, source, recipe, loss_fn = pretrained.model, pretrained.init, pretrained.recipe, pretrained.loss
        else:
            self.model = build_gpt(plan.model, seed=config.seed, device="meta")
        options = EngineOptions(micro_batch=plan.batch.micro_batch, precision=train.precision,
                                fp8=Float8Settings(recipe=train.fp8_recipe, skip=train.fp8_skip),
                                grad_dtype=train.grad_dtype, grad_reduce_dtype=train.grad_reduce_dtype or None,
                                grad_clip=config.optim.grad_clip, recompute=train.recompute, seed=config.seed,
                                on_non_finite="skip" if train.nan_policy == "skip" else "raise", compile=train.compile)
        self.engine: Engine = parallelize(self.model, ctx, optimizer=optimizer_factory(config.optim),
                                          options=options, recipe=recipe, init=source)
        dp, dp_index = ctx.mesh.degree("dp"), ctx.mesh.index("dp")
        if ctx.replicas is not None:  # each step's rows come from the quorum: every rank reads the whole global batch
            dp, dp_index = 1, 0
        self.train_loader, self.val_loader = loaders(plan, data, dp=dp, dp_index=dp_index)
        loggers = check_loggers(train.logger)
        from paratrain.hf.export import carried_files

        settings = LoopSettings(
            steps=train.steps, lr=config.optim.lr, warmup_steps=config.optim.warmup_steps,
            min_lr_ratio=config.optim.min_lr_ratio, lr_schedule=config.optim.lr_schedule,
            decay_fraction=config.optim.decay_fraction, log_every=train.log_every, eval_every=train.eval_every,
            eval_batches=train.eval_batches or 1, save=train.save, save_every=train.save_every,
            keep_last=train.keep_last, save_mode=train.save_mode, memory_copies=train.memory_copies,
            nan_skips=train.nan_skips, check_collectives=train.check_collectives,
            log_json=train.log_json or (f"{train.log_dir}/log.jsonl" if "jsonl" in loggers else ""),
            tensorboard=train.tensorboard or (f"{train.log_dir}/tensorboard" if "tensorboard" in loggers else ""),
            loggers=tuple(n for n in loggers if n in ("wandb", "mlflow")), log_dir=train.log_dir,
            progress=train.progress,
            flops_per_token=plan.model.flops_per_token(plan.seq_len), checkpoint_meta={"config": to_dict(config)},
            checkpoint_files=carried_files(config.model.hf) if config.model.hf else {}, attempt=self.attempt)
        self.loop = start_loop(TrainLoop(self.engine, ctx, loss_fn, self.train_loader, self.val_loader, settings,
                                         hooks=[*run_hooks(plan, job_rank(ctx), self.attempt), *hooks]),
                               resume=train.resume)

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.loop.step

    def fit(self) -> TrainResult:
        done = self.loop.run()
        result = TrainResult(losses=done.losses, val_losses=done.val_losses, tokens_per_s=done.tokens_per_s,
                             mfu=done.mfu)
        sample_tokens = self.plan.config.train.sample_tokens
        # Under ZeRO-3 every forward all-gathers parameters, under tp every layer communicates: then
        # all ranks generate (the same text).
        sharded = self.engine.grads.params_sharded or self.ctx.config.tp > 1
        if self.plan.config.model.hf:  # generate with transformers from the exported folder
            if sample_tokens and self.ctx.is_main:
                self.log.info("no sample for --hf models: `paratrain export CKPT OUT --hf %s`, then generate",
                              self.plan.config.model.hf)
        elif self.engine.pipeline is not None:  # no rank holds the whole model to sample from
            if sample_tokens and self.ctx.is_main:
                self.log.info("no sample under pipeline parallelism (each rank holds only its stage)")
        elif self.ctx.dims.sequence_parts > 1:  # attention runs over the cp ranks' parts of a sequence
            if sample_tokens and self.ctx.is_main:
                self.log.info("no sample under context parallelism (each rank attends through its part of a sequence)")
        elif sample_tokens and (self.ctx.is_main or sharded) and self.source.can_write:
            text = self.sample(sample_tokens)
            result.sample = text if self.ctx.is_main else ""
        self.engine.close()  # the parameter servers leave their loop; hooks and groups released
        return result

    def sample(self, length: int, prompt: str = "The ") -> str:
        """Text generated by the trained model from `prompt` (rank 0; a fixed sampling seed)."""
        self.model.eval()
        ids = torch.tensor([self.source.encode_text(prompt)], device=self.ctx.device)
        generator = torch.Generator().manual_seed(self.plan.config.seed)
        split = self.ctx.config.tp if self.ctx.config.sequence_parallel else 1  # equal sequence parts
        rows = self.ctx.config.tp_row_parts  # a 2d / 2.5d grid splits the rows: that many copies, the first read
        out = self.model.generate(ids.expand(rows, -1), length, generator=generator, pad_to=split)
        self.model.train()
        return self.source.decode(out[0].tolist())
