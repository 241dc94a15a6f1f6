"""`paratrain` command line.

    paratrain train                      the built-in demo: small GPT, built-in corpus, 2 processes
    paratrain train --nproc 4 --dp 4 --global-batch 64 --micro-batch 4 --steps 100
    paratrain train --nproc 4 --dp 2 --tp 2 --sequence-parallel --zero 1
    paratrain train --nproc 8 --dp 2 --tp 2 --pp 2 --schedule 1f1b --micro-batch 2 --zero 2
    paratrain train --config run.toml --steps 50        (flags override the file)
    paratrain presets                    list the model presets
    paratrain tokenize FILES --tokenizer DIR --out DATA
                                         token files (Megatron's layout) for --data DATA
    paratrain plan --model gpt3-175b --gpus 1024 --hardware a100-80gb --global-batch 1536
                                         memory and step time of every layout, best first

Every setting is checked before any process starts (paratrain.cli.launching); a bad one exits with code 2
and the rule, the numbers and a fix. The workers are handed the resolved run as a file (`paratrain worker
--run-plan FILE`, not listed: the launcher starts it), not the command line to parse again.
"""

from __future__ import annotations

import argparse
import sys

from paratrain.cli.flags import build_parser
from paratrain.cli.launching import replica_group, train, worker
from paratrain.config import PRESETS, ConfigError


def _checkpoint_tool(args: argparse.Namespace) -> int:
    import json

    import torch

    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint.tools import describe_checkpoint, export_model, format_description

    try:
        if args.command == "export" and args.hf is not None:
            from paratrain.hf import export_pretrained

            done = export_pretrained(args.checkpoint, args.out, source=args.hf or None,
                                     max_shard_size=args.max_shard_size,
                                     dtype=getattr(torch, args.dtype) if args.dtype else None)
            print(f"wrote {done['out']}: {done['tensors']} tensors in {done['shards']} shards, "
                  f"{done['bytes'] / 2**20:.1f} MiB")
            return 0
        if args.command == "export":
            done = export_model(args.checkpoint, args.out, dtype=args.dtype)
            print(f"wrote {done['out']}: {done['tensors']} tensors, {done['bytes'] / 2**20:.1f} MiB")
            return 0
        record = describe_checkpoint(args.checkpoint)
    except (FileNotFoundError, CheckpointError) as error:
        print(f"paratrain {args.command}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(record) if args.json else format_description(record))
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from paratrain.data.tokenize import TrainBpe, tokenize_corpus

    if args.chat:
        from paratrain.data.chat import tokenize_chat

        if not args.tokenizer:
            raise ConfigError("--chat renders conversations with a tokenizer's chat template: give --tokenizer DIR")
        record = tokenize_chat(args.files, args.out, tokenizer=args.tokenizer, messages_key=args.messages_key,
                               eos_token=args.eos_token, val_fraction=args.val_fraction, progress=args.progress)
        print(f"wrote {args.out}: {record['train']['documents']} conversations, {record['train']['tokens']} tokens "
              f"({record['train']['loss_tokens']} in the loss) for training, {record['val']['documents']} for "
              "validation")
        return 0
    record = tokenize_corpus(args.files, args.out, tokenizer=args.tokenizer or TrainBpe(args.train_bpe),
                             text_key=args.text_key, eos_token=args.eos_token, workers=args.workers,
                             val_fraction=args.val_fraction, progress=args.progress)
    print(f"wrote {args.out}: {record['train']['documents']} documents, {record['train']['tokens']} tokens for "
          f"training, {record['val']['documents']} documents, {record['val']['tokens']} tokens for validation "
          f"({record['dtype']}, vocabulary {record['tokenizer']['vocab_size']})")
    return 0


def _presets() -> int:
    print(f"{'preset':<14} {'params':>10} {'layers':>6} {'d_model':>7} {'heads':>5} {'seq':>5} {'vocab':>6}  experts")
    for name, config in PRESETS.items():
        experts = (f"{config.n_experts} x top-{config.top_k}, {config.active_params() / 1e6:.1f}M active"
                   if config.n_experts else "-")
        print(f"{name:<14} {config.num_params() / 1e6:>9.1f}M {config.n_layer:>6} {config.d_model:>7} "
              f"{config.n_head:>5} {config.seq_len:>5} {config.vocab_size:>6}  {experts}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train(args)
        if args.command == "worker":
            return worker(args)
        if args.command == "replica-group":
            return replica_group(args)
        if args.command == "plan":
            from paratrain.planner.command import run

            return run(args)
        if args.command == "plot":
            from paratrain.plot import plot_runs

            labels = args.labels.split(",") if args.labels else None
            print(f"wrote {plot_runs(args.runs, args.out, labels=labels, log_y=args.log_y)}")
            return 0
        if args.command == "scaling":
            from paratrain.scaling import run as scaling

            return scaling(args)
        if args.command in ("inspect", "export"):
            return _checkpoint_tool(args)
        if args.command == "tokenize":
            return _tokenize(args)
        if args.command == "replay":
            from paratrain.train.replay import replay

            return replay(args)
        return _presets()
    except ConfigError as error:
        print(f"paratrain: invalid configuration: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as error:  # paratrain plot's inputs
        if args.command != "plot":
            raise
        print(f"paratrain plot: {error}", file=sys.stderr)
        return 1
