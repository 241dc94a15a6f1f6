"""The arguments of `paratrain`'s tool commands: presets, inspect, export, replay, tokenize and plot (train's are
paratrain.cli.flags'; plan's paratrain.planner.command's)."""

from __future__ import annotations

import argparse


def add_tool_commands(commands: argparse._SubParsersAction) -> None:
    commands.add_parser("presets", help="list the model presets and their sizes")
    inspect = commands.add_parser("inspect", help="verify a checkpoint and list what it holds")
    inspect.add_argument("checkpoint", help="a folder written by --save (its latest checkpoint), or one step_* folder")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    export = commands.add_parser("export", help="write a checkpoint's model tensors to one plain safetensors file, "
                                                "or (--hf) a folder Hugging Face's from_pretrained loads")
    export.add_argument("checkpoint", help="a folder written by --save (its latest checkpoint), or one step_* folder")
    export.add_argument("out", help="the .safetensors file to write (with --hf: the folder)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                        help="cast floating tensors to this dtype (default: as saved)")
    export.add_argument("--hf", metavar="SOURCE", nargs="?", const="", help="write OUT as a Hugging Face folder "
                        "(sharded safetensors, config.json, tokenizer files); SOURCE: the folder the model was loaded "
                        "from (default: the configuration an --hf run's checkpoint carries)")
    export.add_argument("--max-shard-size", default="5GB", help="with --hf: the largest shard (default 5GB)")
    replay = commands.add_parser("replay", help="recompute one step of a run on one process from its checkpoint: "
                                                "loss, gradient norm, per-tensor norms, the worst samples")
    replay.add_argument("checkpoint", help="the run's --save folder (its newest checkpoint before the step is used), "
                        "or one step_* folder")
    replay.add_argument("--step", type=int, required=True, help="the step to recompute (as logged: 1 is the first)")
    replay.add_argument("--log", default="", help="the run's --log-json file, for the logged loss and gradient norm "
                        "(default: the path the checkpoint's config names)")
    replay.add_argument("--top", type=int, default=5, help="samples with the largest losses to show (default 5)")
    replay.add_argument("--device", default="cpu", help="where to recompute: cpu (default), cuda or auto")
    replay.add_argument("--json", action="store_true", help="print one JSON object (loss, grad_norm, logged_loss, "
                        "logged_grad_norm, tensors, samples)")
    tokenize = commands.add_parser("tokenize", help="tokenize text, jsonl or parquet files into Megatron-layout "
                                                    "token files (train / val .bin + .idx) with a local tokenizer")
    tokenize.add_argument("files", nargs="+", metavar="FILE", help=".txt / .md (a document each), .jsonl (a "
                          "document per line) or .parquet files")
    tokenize.add_argument("--out", required=True, help="the folder to write (must not exist)")
    which = tokenize.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder (its tokenizer.json)")
    which.add_argument("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB entries here")
    tokenize.add_argument("--text-key", default="text", help="the text field of .jsonl records / .parquet column")
    tokenize.add_argument("--chat", action="store_true", help="the .jsonl records are conversations: render them with "
                          "the tokenizer's chat template and write a loss mask (loss on the assistant's tokens only; "
                          "needs --tokenizer and transformers)")
    tokenize.add_argument("--messages-key", default="messages", help="with --chat: the conversation field")
    tokenize.add_argument("--eos-token", help="the end-of-sequence token (default: the tokenizer's configured one)")
    tokenize.add_argument("--workers", type=int, default=1, help="encoding processes (the output is the same bytes)")
    tokenize.add_argument("--val-fraction", type=float, default=0.01,
                          help="every 1/F-th document goes to the validation split (default 0.01)")
    tokenize.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    plot = commands.add_parser("plot", help="draw the loss curves of runs (--log-json files) on one figure")
    plot.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="files written by --log-json")
    plot.add_argument("-o", "--out", default="curves.png", help="the picture to write (default curves.png)")
    plot.add_argument("--labels", help="comma-separated names of the runs (default: the file names)")
    plot.add_argument("--log-y", action="store_true", help="a logarithmic loss axis")
