"""`paratrain train` before and after the launch: every check the launching process makes (prepare_launch),
the planner's layout under --plan auto, the run file it hands the workers, and what each worker runs.

The launching process resolves the run once: flags, TOML, SLURM's variables and --smp become a RunConfig,
--plan auto fills in the planner's layout, and the result is written as JSON (paratrain.config.write_run).
Each worker is started as `python -m paratrain worker --run-plan FILE` and builds its RunPlan from that
file against the world it meets (an elastic relaunch with fewer nodes has a smaller dp), parsing no flags.
A job started by an external torchrun runs `paratrain train` on every process, which trains from the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from paratrain.cli.flags import run_config_from_args
from paratrain.config import (ConfigError, RunConfig, RunPlan, check_run, launch_world_size, preset, read_run,
                              resolve_device, write_run)


def checked_run(config: RunConfig, world_size: int) -> RunPlan:
    """check_run for a run of any model: a Hugging Face folder's shape read from its config.json."""
    from paratrain.hf.load import run_model_shape  # torch: imported when a run is checked, not for --help

    return check_run(config, world_size, model_shape=run_model_shape)


def prepare_launch(config: RunConfig, *, gpus: int) -> RunPlan:
    """Every check the launching process makes before any worker starts: the world size and devices,
    every rule of the run, the data, and (unless switched off) the planner's memory prediction.
    Returns the RunPlan; raises ConfigError with the rule, the numbers and a fix."""
    world_size = launch_world_size(config, gpus=gpus)
    config.launch.nproc = world_size // config.launch.nnodes
    if config.parallel.fault_tolerance == "replica" and config.launch.replica_group >= 0:
        world_size *= config.parallel.replica_groups  # this launcher runs one replica group of the job
    servers = config.parallel.ps_servers  # dedicated parameter servers: the last node starts them too
    if servers and config.launch.nnodes > 1 and config.launch.rdzv_backend != "static":
        raise ConfigError(f"--ps-servers {servers} across nodes needs the static rendezvous (--rdzv-backend static, "
                          "each node its --node-rank): the last node starts the servers, which must be the world's "
                          "last ranks")
    config.launch.servers = servers if config.launch.node_rank == config.launch.nnodes - 1 else 0
    config.launch.first_server = world_size if servers else 0
    plan = checked_run(config, world_size + servers)
    fewer = {}  # a relaunch that goes on with fewer nodes (--min-nodes) must have a valid layout too
    for nodes in range(config.launch.min_nodes or config.launch.nnodes, config.launch.nnodes):
        try:
            fewer[nodes] = checked_run(config, config.launch.nproc * nodes)
        except ConfigError as error:
            raise ConfigError(f"with {nodes} of {config.launch.nnodes} nodes (--min-nodes "
                              f"{config.launch.min_nodes}): {error}") from None
    from paratrain.data import open_data
    from paratrain.train import check_data

    data = config.data
    try:
        opened = open_data(data.source, path=data.path, schedule=data.schedule, val_fraction=data.val_fraction,
                           split=data.split)
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"data {' '.join(data.path) if data.path else repr(data.source)}: {error}") from None
    check_data(plan, opened)
    if config.train.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"--tensorboard {config.train.tensorboard}: the tensorboard package is not installed: "
                              "pip install 'paratrain[viz]' (or tensorboard), or drop --tensorboard")
    if config.train.resume == "auto":
        if not config.train.save:
            raise ConfigError("--resume auto takes the newest verified checkpoint under --save: give --save DIR")
    elif config.train.resume:
        from paratrain.checkpoint import CheckpointError, resolve_checkpoint, verify_checkpoint

        try:  # sizes, headers and index here; the workers share out the SHA-256s (verify_shared)
            verify_checkpoint(resolve_checkpoint(config.train.resume), hashed=())
        except FileNotFoundError as error:
            raise ConfigError(f"train.resume: {error}: give a folder written by --save (its latest checkpoint is "
                              "taken) or one of its step_* folders") from None
        except CheckpointError as error:
            raise ConfigError(f"train.resume: {error}") from None
    if config.launch.memory_check and config.model.hf:  # another family: its ranks dry-run and measured
        from paratrain.planner.check import available_memory, check_memory_hf

        device = resolve_device(config.launch.device, gpus=gpus)
        available = available_memory(device)
        if available is not None:
            check_memory_hf(plan, device=device, available_bytes=available, processes=config.launch.nproc)
    elif config.launch.memory_check:
        from paratrain.planner.check import available_memory, check_memory

        device = resolve_device(config.launch.device, gpus=gpus)
        available = available_memory(device)
        if available is not None:
            check_memory(plan, device=device, available_bytes=available, processes=config.launch.nproc)
            for nodes, smaller in fewer.items():  # less dp: larger ZeRO shards, more accumulation
                try:
                    check_memory(smaller, device=device, available_bytes=available, processes=config.launch.nproc)
                except ConfigError as error:
                    raise ConfigError(f"with {nodes} of {config.launch.nnodes} nodes (--min-nodes "
                                      f"{config.launch.min_nodes}): {error}") from None
    return plan


def train(args: argparse.Namespace) -> int:
    """`paratrain train`: check, plan, write the run file and launch (or train here: one process, or a
    worker of an external torchrun)."""
    from paratrain.launch import JobFailed, launch, launched_by_torchrun

    config = tokenize_text_for_hf(run_config_from_args(args))
    if launched_by_torchrun():  # a worker of a job an external torchrun started: train here
        return train_worker(config)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.launch.plan == "auto":
        config = plan_auto(config, args, gpus=gpus)
    if config.parallel.fault_tolerance == "replica" and config.launch.replica_group >= 0:
        from paratrain.launch.replicas import one_group_launch

        config.launch = one_group_launch(config.launch)  # a group lies inside a node, whatever --nnodes said
    plan = prepare_launch(config, gpus=gpus)
    if plan.parallel.fault_tolerance == "replica" and config.launch.replica_group < 0:
        from paratrain.launch.replicas import launch_replica_groups

        return launch_replica_groups(config, plan)
    if plan.parallel.world_size // max(1, plan.parallel.replica_groups if plan.parallel.fault_tolerance == "replica"
                                       else 1) == 1:  # one process: no launcher, no process group
        from paratrain.launch import train_on_this_rank

        train_on_this_rank(plan)
        return 0
    with tempfile.TemporaryDirectory(prefix="paratrain-run-") as folder:  # this node's workers read it
        run_file = write_run(config, Path(folder) / "run.json")
        try:
            launch(config.launch, run_file, shared=config.train.save or None,
                   memory_copies=config.train.memory_copies)
        except JobFailed as failure:
            print(f"paratrain: {failure}", file=sys.stderr)
            return 1
    return 0


def tokenize_text_for_hf(config: RunConfig) -> RunConfig:
    """With --hf, text data (builtin, .txt, .jsonl, .parquet, a folder of text shards; the mixture's sources too)
    tokenized by the model's own tokenizer, once and cached (paratrain.data.text), and the run pointed at those token
    files; said in one line each. Without --hf, or with token files, the config as it is."""
    if not config.model.hf:
        return config
    data = config.data
    if data.path:  # weight, source, weight, source, ...
        path = tuple(item if n % 2 == 0 else _tokenized_for_hf(item, config) for n, item in enumerate(data.path))
        return dataclasses.replace(config, data=dataclasses.replace(data, path=path))
    return dataclasses.replace(config, data=dataclasses.replace(data, source=_tokenized_for_hf(data.source, config)))


def _tokenized_for_hf(source: str, config: RunConfig) -> str:
    """One source as the HF model's tokens: a text file or folder of text shards tokenized (cached), else as it is."""
    from paratrain.data.shards import index_prefixes, is_shard_folder
    from paratrain.data.text import is_text, tokenized, tokenized_shards

    data = config.data
    if is_text(source) and not data.path:
        folder, cached = tokenized(source, config.model.hf, val_fraction=data.val_fraction, cache=data.cache)
    elif is_shard_folder(source) and not index_prefixes(Path(source)):
        folder, cached = tokenized_shards(source, config.model.hf, workers=data.workers, cache=data.cache)
    else:
        return source
    if os.environ.get("RANK", "0") == "0":
        print(f"paratrain: --data {source} read as {config.model.hf}'s tokens: {'cached in' if cached else 'tokenized into'} "
              f"{folder}", file=sys.stderr)
    return str(folder)


def plan_auto(config: RunConfig, args: argparse.Namespace, *, gpus: int) -> RunConfig:
    """The run with the planner's layout for this job's processes (flags given are pins it keeps)."""
    from paratrain.cli.flags import given_paths
    from paratrain.config.layout import layout_of
    from paratrain.planner.auto import choose_layout, device_hardware
    from paratrain.planner.check import available_memory

    world_size = launch_world_size(config, gpus=gpus)
    device = resolve_device(config.launch.device, gpus=gpus)
    hw = device_hardware(device, processes=world_size // config.launch.nnodes, available_bytes=available_memory(device))
    pins = layout_of(config, given_paths(args))  # every layout setting given is a pin the search keeps
    seq_len = config.data.seq_len or preset(config.model.preset, **config.model.overrides).seq_len
    config, text = choose_layout(config, world_size=world_size, hw=hw, pins=pins, seq_len=seq_len)
    print(f"paratrain: {text}", file=sys.stderr)
    return config


def replica_group(args: argparse.Namespace) -> int:
    """`paratrain replica-group --run-plan FILE`: one replica group of a fault-tolerant job (its own launcher and
    world), as the job's first launcher starts it (paratrain.launch.replicas)."""
    from paratrain.launch import JobFailed, launch, train_on_this_rank

    config = read_run(args.run_plan)
    if config.launch.nproc == 1:
        train_on_this_rank(checked_run(config, config.parallel.replica_groups))
        return 0
    try:
        launch(config.launch, Path(args.run_plan), shared=config.train.save or None)
    except JobFailed as failure:
        print(f"paratrain: replica group {config.launch.replica_group}: {failure}", file=sys.stderr)
        return 1
    return 0


def worker(args: argparse.Namespace) -> int:
    """`paratrain worker --run-plan FILE`: one process of a job `paratrain train` launched."""
    from paratrain.launch import launched_by_torchrun

    if not launched_by_torchrun():
        raise ConfigError("paratrain worker is what `paratrain train` starts on each process of a job (RANK and "
                          "WORLD_SIZE set): run `paratrain train` instead")
    config = read_run(args.run_plan)
    launch = dataclasses.replace(config.launch, attempt=args.attempt, flight_dir=args.flight_dir)
    return train_worker(dataclasses.replace(config, launch=launch))


def train_worker(config: RunConfig) -> int:
    """Build this worker's RunPlan against the job's world size, train, and leave (the process exits)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from paratrain.launch import leave, train_on_this_rank

    @record
    def main() -> None:
        world = int(os.environ["WORLD_SIZE"])
        if config.parallel.fault_tolerance == "replica":  # this world is one replica group of the job
            world *= config.parallel.replica_groups
        train_on_this_rank(checked_run(config, world))

    main()
    leave()
    return 0  # not reached: leave() exits the process
