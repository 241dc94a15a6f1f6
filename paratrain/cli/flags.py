"""The arguments of `paratrain`: its subcommands, and `paratrain train`'s flags as RunConfig settings."""

from __future__ import annotations

import argparse
import os
from typing import Any

from paratrain.cli.tools import add_tool_commands
from paratrain.config import PRESETS, SCHEDULES, RunConfig, build_run_config, load_toml


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, e.g. 3,6,9; got {text!r}") from None


# flag -> (dotted config path, type, help)
TRAIN_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--nproc": ("launch.nproc", int, "processes on this node (default with --dp: dp x tp x pp x cp and --ps-servers "
                "over nnodes; without: one per GPU on CUDA, 2 on the CPU)"),
    "--nnodes": ("launch.nnodes", int, "nodes in the job (default 1)"),
    "--node-rank": ("launch.node_rank", int, "this node's rank, 0..nnodes-1 (static rendezvous)"),
    "--rdzv-endpoint": ("launch.rdzv_endpoint", str, "HOST:PORT of node 0, for nnodes > 1"),
    "--rdzv-backend": ("launch.rdzv_backend", str, "static (default) or c10d"),
    "--rdzv-id": ("launch.rdzv_id", str, "job id shared by all nodes"),
    "--device": ("launch.device", str, "cpu (gloo), cuda (NCCL, one GPU per process) or auto (default: cuda when "
                 "a GPU is visible; then nproc defaults to the GPU count)"),
    "--max-restarts": ("launch.max_restarts", int, "restart the workers this many times when a rank fails, "
                       "resuming from the newest verified checkpoint under --save"),
    "--min-nodes": ("launch.min_nodes", int, "with --max-restarts and --rdzv-backend c10d: a restart goes on with at "
                    "least this many nodes if others do not come back (dp recomputed, global batch kept)"),
    "--timeout": ("launch.timeout_s", float, "seconds a collective may wait before the job fails"),
    "--dp": ("parallel.dp", int, "data-parallel degree (default: world size / (tp x pp))"),
    "--tp": ("parallel.tp", int, "tensor-parallel degree: layers split over tp ranks (divides heads, ff and padded vocab)"),
    "--pp": ("parallel.pp", int, "pipeline-parallel degree: layers cut into pp stages"),
    "--schedule": ("parallel.schedule", str, f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b; "
                   "docs/pipeline.md)"),
    "--virtual-stages": ("parallel.virtual_stages", int, "chunks per pipeline rank (interleaved schedule)"),
    "--pp-split": ("parallel.pp_split", _int_tuple, "first layer of each pipeline chunk after the first, e.g. 3,6,9 "
                   "(GPT layers: 0 embedding, 1..n blocks, n+1 head); default: balanced by cost"),
    "--pp-layout": ("parallel.pp_layout", str, "the cut layer by layer in Megatron's spelling, e.g. 'Et*3|t*4|t*4|t*3L' "
                    "(E embedding, t block, m MTP depth, L head and loss, | between chunks; docs/pipeline.md)"),
    "--microbatches": ("parallel.microbatches", int, "micro-batches per pipeline step; must equal G / (m x dp)"),
    "--zero": ("parallel.zero", int, "ZeRO stage over dp: 0 (plain DP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)"),
    "--shard-group": ("parallel.shard_group", int, "hierarchical sharding: shard inside groups of S dp ranks"),
    "--offload": ("parallel.offload", str, "optimizer: optimizer state and master weights in CPU memory (zero >= 1); "
                  "activations: each block's saved activations in pinned CPU memory between forward and backward; "
                  "optimizer,activations: both"),
    "--grad-reduce": ("parallel.grad_reduce", str, "sharded gradients: auto, reduce_scatter or all_reduce"),
    "--bucket-mb": ("parallel.bucket_mb", float, "gradient all-reduce bucket size in MiB (default 25)"),
    "--model": ("model.preset", str, f"model preset: {', '.join(PRESETS)}"),
    "--hf": ("model.hf", str, "train the model of a local Hugging Face folder (config.json + safetensors; Llama, "
                              "Mistral, Qwen2/3, Gemma, GPT-2) instead of --model, each rank reading its pieces from the files"),
    "--vocab-size": ("model.overrides.vocab_size", int, "the model's vocabulary (e.g. the tokenizer's, for token "
                     "files `paratrain tokenize` wrote)"),
    "--experts": ("model.overrides.n_experts", int, "Mixture-of-Experts: experts per MoE layer (0: dense MLPs)"),
    "--top-k": ("model.overrides.top_k", int, "experts each token is routed to: 1 .. 8 (at most --experts)"),
    "--router": ("model.overrides.router", str, "router scores: softmax (default) or sigmoid (DeepSeek-V3; the chosen "
                 "weights renormalised)"),
    "--expert-groups": ("model.overrides.expert_groups", int, "group-limited routing: experts in G groups, a token's "
                        "chosen from its --topk-groups best (DeepSeek's n_group; default 1: none)"),
    "--topk-groups": ("model.overrides.topk_groups", int, "groups a token's experts may come from (topk_group)"),
    "--router-scale": ("model.overrides.router_scale", float, "the chosen experts' weights times this "
                       "(routed_scaling_factor; default 1)"),
    "--expert-bias": ("model.overrides.expert_bias_rate", float, "auxiliary-loss-free balancing: a per-expert bias "
                      "for choosing, moved this much a step from the global batch's counts (DeepSeek-V3: 0.001; "
                      "default 0: off)"),
    "--moe-every": ("model.overrides.moe_every", int, "a MoE layer in every N-th block (default 1: every block)"),
    "--capacity-factor": ("model.overrides.capacity_factor", float, "assignments an expert takes per sequence: "
                          "ceil(F x seq x top_k / experts); 0: dropless (default)"),
    "--aux-loss-coef": ("model.overrides.aux_loss_coef", float, "weight of the Switch load-balancing loss (default 0.01)"),
    "--global-aux-coef": ("model.overrides.global_aux_coef", float, "weight of the global-batch load-balancing loss "
                          "(the previous global batch's load fractions x the router probabilities; default 0: off)"),
    "--z-loss-coef": ("model.overrides.z_loss_coef", float, "weight of the router z-loss (default 0.001)"),
    "--mtp-depth": ("model.overrides.mtp_depth", int, "multi-token prediction (DeepSeek-V3): D extra depths after the "
                    "last block, depth k predicting the token k + 1 ahead (default 0: off)"),
    "--mtp-weight": ("model.overrides.mtp_weight", float, "the MTP losses' weight lambda: the loss is the next-token "
                     "loss + lambda / D x the depths' (default 0.3)"),
    "--tp-mode": ("parallel.tp_mode", str, "how tp splits each layer: 1d (Megatron's slices, default), 2d (a q x q "
                  "grid, tp = q^2: weights and activations in blocks, SUMMA), 2.5d (--tp-depth such grids, tp = d "
                  "q^2, the batch split over depth too) or 3d (a q^3 cube); with dp and ZeRO"),
    "--tp-depth": ("parallel.tp_depth", int, "2.5d: the grids stacked, each on its share of the batch rows"),
    "--cp": ("parallel.cp", int, "context-parallel degree: each sequence split over cp ranks (composes with every "
                                 "axis; the sequence must divide into 2 x cp chunks)"),
    "--cp-mode": ("parallel.cp_mode", str, "ring (K/V blocks round the cp ranks), ulysses (all-to-all to head "
                                           "shards; heads must divide by cp) or usp (Ulysses over --cp-ulysses "
                                           "ranks, a ring across them)"),
    "--cp-ulysses": ("parallel.cp_ulysses", int, "--cp-mode usp: the Ulysses degree U (1 < U < cp, dividing cp and "
                                                 "the heads per tp rank); the ring has cp / U ranks"),
    "--cp-balance": ("parallel.cp_balance", str, "what the split of each sequence balances over cp: positions "
                                                  "(the causal split, default) or documents (packed documents' "
                                                  "attention work, micro-batch by micro-batch)"),
    "--ep": ("parallel.ep", int, "expert-parallel degree: the experts divided among ep ranks of dp (divides dp "
             "and the expert count)"),
    "--ps-mode": ("parallel.ps_mode", str, "the parameter server: off (collectives), sync (data parallelism's result "
                  "exactly) or async (bounded staleness, needs --ps-servers)"),
    "--ps-servers": ("parallel.ps_servers", int, "dedicated parameter-server processes beside the --nproc trainers "
                     "(0: each trainer serves a slice, ZeRO-2's traffic)"),
    "--staleness": ("parallel.staleness", int, "--ps-mode async: clocks a trainer may run ahead of the slowest"),
    "--fault-tolerance": ("parallel.fault_tolerance", str, "off, or replica: --replica-groups groups of dp that "
                          "survive each other (a lost group costs a step, not a relaunch; a group started again with "
                          "--replica-group G --lighthouse HOST:PORT joins the running job)"),
    "--replica-group": ("launch.replica_group", int, "--fault-tolerance replica: start this replica group alone (a "
                        "lost one, again), meeting the others at --lighthouse"),
    "--lighthouse": ("launch.lighthouse", str, "--fault-tolerance replica: HOST:PORT of the running job's store (its "
                     "first launcher prints it)"),
    "--dp-mode": ("parallel.dp_mode", str, "sync (gradients summed over dp every step, default) or diloco (replica "
                  "groups train apart, meeting every --inner-steps steps for an outer Nesterov step)"),
    "--replica-groups": ("parallel.replica_groups", int, "--dp-mode diloco or --fault-tolerance replica: the groups "
                         "of consecutive dp ranks (divides dp; ZeRO shards inside a group)"),
    "--inner-steps": ("parallel.inner_steps", int, "--dp-mode diloco: steps each group takes between outer steps (H)"),
    "--outer-lr": ("parallel.outer_lr", float, "--dp-mode diloco: the outer step's learning rate (default 0.7)"),
    "--outer-momentum": ("parallel.outer_momentum", float, "--dp-mode diloco: the outer step's Nesterov momentum "
                         "(default 0.9)"),
    "--outer-fragments": ("parallel.outer_fragments", int, "--dp-mode diloco: Streaming DiLoCo's fragments of the "
                          "model, staggered over the inner steps (divides --inner-steps; default 1)"),
    "--data": ("data.source", str, "builtin, a .txt / .jsonl / .parquet file (bytes for the GPT; with --hf tokenized "
                                   "by the model's tokenizer, cached), a folder `paratrain tokenize` wrote (or "
                                   "Megatron's train/val .bin + .idx), a folder with train.bin/val.bin (uint16), a "
                                   "Megatron PREFIX, or a folder of shards (.bin/.idx pairs; .jsonl/.parquet with "
                                   "--hf) read lazily"),
    "--data-workers": ("data.workers", int, "processes tokenizing a folder of text shards for --hf, one shard each "
                       "(the same tokens for any number; default 1)"),
    "--val-fraction": ("data.val_fraction", float, "share of a text source held out for validation (default 0.1; "
                       "documents: every 1/f-th, as `paratrain tokenize` splits)"),
    "--split": ("data.split", str, "a Megatron prefix's (or a shard folder's) train,validation,test shares, split "
                "by sequence as megatron-core splits (default 969,30,1)"),
    "--data-schedule": ("data.schedule", str, "--data-path's weights by step: 'STEP:W1,W2,...;STEP:...' from step 0, "
                        "e.g. '0:0.7,0.3;8000:0.4,0.6' (an anneal changes nothing before its step)"),
    "--data-cache": ("data.cache", str, "where text tokenized for --hf is kept (default: ~/.cache/paratrain/tokens)"),
    "--documents": ("data.documents", str, "document masking of packed windows: on (needs a tokenized folder's "
                    "document index), off, or auto (default: on for --hf when the data has an index, in every layout)"),
    "--seq-len": ("data.seq_len", int, "tokens per sample (default: the model's)"),
    "--global-batch": ("data.global_batch", int, "samples per optimizer step, all ranks together"),
    "--micro-batch": ("data.micro_batch", int, "samples per forward/backward per rank (accumulation = G / (m x dp))"),
    "--seq-warmup": ("data.seq_warmup", str, "START,STEPS: read each sample as sequences of START tokens, doubling to "
                     "--seq-len over the first STEPS steps (the same samples and targets, more micro-batches)"),
    "--batch-rampup": ("data.batch_rampup", str, "START,INCREMENT,SAMPLES: the global batch grows from START by "
                       "INCREMENT over SAMPLES samples up to --global-batch (Megatron's --rampup-batch-size; needs "
                       "--micro-batch)"),
    "--steps": ("train.steps", int, "optimizer steps"),
    "--optimizer": ("optim.optimizer", str, "adamw (default), muon (Muon on the weight matrices, AdamW on embeddings, "
                    "head, norms and biases; every layout) or sgd (momentum 0.9)"),
    "--lr": ("optim.lr", float, "peak learning rate (Muon's too, scaled per matrix by --muon-adjust-lr)"),
    "--lr-schedule": ("optim.lr_schedule", str, "after warmup: cosine (default), wsd (warmup-stable-decay: flat, then "
                      "the last --decay-fraction of the steps straight down), linear or constant"),
    "--decay-fraction": ("optim.decay_fraction", float, "wsd: the share of the steps spent decaying (default 0.2)"),
    "--min-lr-ratio": ("optim.min_lr_ratio", float, "the schedule ends at lr x this (default 0.1)"),
    "--weight-decay": ("optim.weight_decay", float, "decoupled weight decay on matrices (default 0.1)"),
    "--optim-state-dtype": ("optim.state_dtype", str, "optimizer state storage: fp32 (default) or bf16 (AdamW's moments "
                            "and Muon's momentum in bfloat16, half the bytes; the float32 master kept)"),
    "--muon-momentum": ("optim.muon_momentum", float, "Muon's momentum (default 0.95)"),
    "--muon-ns-steps": ("optim.muon_ns_steps", int, "Newton-Schulz iterations per matrix (default 5)"),
    "--muon-ns-dtype": ("optim.muon_ns_dtype", str, "Newton-Schulz dtype: bf16 (default, torch's), fp32 or fp64"),
    "--muon-adjust-lr": ("optim.muon_adjust_lr", str, "match_rms_adamw (default: one lr for Muon and AdamW), "
                         "original (Keller Jordan's; give Muon's own lr) or none"),
    "--muon-exclude": ("optim.muon_exclude", str, "regex of 2-D parameter names AdamW updates instead of Muon "
                       "(default: embeddings and output heads)"),
    "--warmup": ("optim.warmup_steps", int, "warmup steps"),
    "--grad-clip": ("optim.grad_clip", float, "clip the global gradient norm (0: off)"),
    "--precision": ("train.precision", str, "fp32, bf16, fp16 (dynamic loss scaling) or fp8 (bf16, the blocks' "
                    "linears in float8)"),
    "--fp8-recipe": ("train.fp8_recipe", str, "under --precision fp8: tensorwise (a scale per tensor, e5m2 "
                     "gradients) or rowwise (a scale per row)"),
    "--fp8-skip": ("train.fp8_skip", str, "under --precision fp8: regex of the blocks' linears left in bf16 "
                   "(default: Hugging Face MoE routers)"),
    "--grad-dtype": ("train.grad_dtype", str, "under ZeRO with bf16 / fp16: gradients accumulate and are summed in "
                     "fp32 (default) or the precision's 16 bits (bf16 / fp16: half the bytes)"),
    "--grad-reduce-dtype": ("train.grad_reduce_dtype", str, "the dtype gradients are reduced in (default: "
                            "--grad-dtype's; bf16 under fp32 buffers halves the bytes on the wire)"),
    "--log-every": ("train.log_every", int, "read the loss back and log every N steps (default 1; on a GPU, "
                    "steps in between queue without waiting for the device)"),
    "--eval-every": ("train.eval_every", int, "validate every N steps (0: only at the end)"),
    "--save": ("train.save", str, "checkpoint folder"),
    "--save-every": ("train.save_every", int, "checkpoint every N steps (0: only at the end)"),
    "--keep-last": ("train.keep_last", int, "keep only the newest N checkpoints (0: all)"),
    "--save-mode": ("train.save_mode", str, "sync (the step waits for the files) or async (for a copy in shared "
                                            "memory; a writer process per rank writes them)"),
    "--memory-copies": ("train.memory_copies", int, "with --save-mode async across nodes: also keep each rank's "
                        "checkpoint in the RAM of N other nodes; a relaunch resumes from memory (0: disk only)"),
    "--resume": ("train.resume", str, "resume from this checkpoint folder (verified first), or auto: the newest "
                 "checkpoint under --save that verifies (none: start at step 0)"),
    "--log-json": ("train.log_json", str, "write one JSON object per step to this file"),
    "--tensorboard": ("train.tensorboard", str, "write TensorBoard scalars (loss, val loss, lr, grad norm, tokens/s, "
                                                "MFU, memory) to this folder (needs paratrain[viz])"),
    "--sample-tokens": ("train.sample_tokens", int, "length of the text sample printed at the end"),
    "--nan-policy": ("train.nan_policy", str, "a nan or inf loss or gradient norm: stop (default: name the step, "
                     "ranks and newest checkpoint) or skip the update"),
    "--nan-skips": ("train.nan_skips", int, "with --nan-policy skip: the most steps to skip before stopping (default 10)"),
    "--logger": ("train.logger", str, "loggers, comma-separated: jsonl, tensorboard, wandb (offline unless "
                 "WANDB_MODE), mlflow (MLFLOW_TRACKING_URI, else sqlite under --log-dir)"),
    "--log-dir": ("train.log_dir", str, "where --logger's loggers write (default paratrain-logs)"),
    "--inject": ("train.inject", str, "faults a run survives, for testing: bitflip:RANK:STEP (a bit of a reduced "
                 "gradient), slow:RANK:MS (a rank slowed each step), spike:STEP (a corrupted batch); comma-separated"),
    "--check-replicas": ("train.check_replicas", int, "every N steps compare the replicas' parameter fingerprints; a "
                         "mismatch stops the run naming the rank and tensor (0: off)"),
    "--straggler-factor": ("train.straggler_factor", float, "name a rank whose median busy time over "
                           "--straggler-steps steps is more than F x the others' (0: off)"),
    "--straggler-steps": ("train.straggler_steps", int, "the window of steps a straggler is judged over (default 5)"),
    "--profile": ("train.profile", int, "torch.profiler traces of N steps (after 2), one per rank (0: off)"),
    "--profile-dir": ("train.profile_dir", str, "where --profile and --memory-snapshot write (default "
                      "paratrain-profile)"),
    "--memory-snapshot": ("train.memory_snapshot", int, "after step N (or an out-of-memory error before it) each "
                          "rank writes its memory beside the planner's prediction; on CUDA the allocator history"),
    "--spike-policy": ("train.spike_policy", str, "a step whose loss exceeds the recent median by --spike-sigma x the "
                       "loss's step-to-step noise: skip its update, or rollback (take it again on the next batch); "
                       "off (default)"),
    "--spike-sigma": ("train.spike_sigma", float, "how many times the noise over the median makes a spike (default 6)"),
    "--spike-window": ("train.spike_window", int, "recent losses the spike test reads (default 50)"),
    "--skip-batches": ("train.skip_batches", str, "global batches to skip, e.g. 3,10-12: their step trains on the "
                       "next one (after a loss spike)"),
    "--fail-at": ("train.fail_at", str, "fault injection for tests: RANK:STEP raises on that rank at that step, "
                  "RANK:STEP:kill SIGKILLs it, RANK:STEP:hang hangs it, RANK:STEP:kill-saving SIGKILLs it while "
                  "saving step STEP, RANK:STEP:kill-node SIGKILLs its node (launcher and workers)"),
}


def build_parser() -> argparse.ArgumentParser:
    """The `paratrain` command line: its subcommands and their arguments."""
    parser = argparse.ArgumentParser(prog="paratrain", description="Distributed training, explicit and layout-invariant.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    train = commands.add_parser("train", help="train a model (no flags: the built-in demo on 2 processes)")
    train.add_argument("--config", help="TOML file with [model] [parallel] [data] [optim] [train] [launch] tables")
    train.add_argument("--seed", type=int, default=None, help="seed of init and data order (default 1234)")
    for flag, (_, kind, text) in TRAIN_FLAGS.items():
        train.add_argument(flag, type=kind, default=None, help=text)
    train.add_argument("--recompute", nargs="?", const="full", default=None, choices=("none", "full", "selective"),
                       help="recompute activations in backward: full (each block; the default of a bare --recompute) "
                            "or selective (each block's attention core)")
    train.add_argument("--check-collectives", action="store_true", default=None,
                       help="compare the ranks' sequences of collectives after every step (always after the first)")
    train.add_argument("--compile", action="store_true", default=None,
                       help="torch.compile each transformer block (collectives and keyed dropout stay eager)")
    train.add_argument("--sequence-parallel", action="store_true", default=None,
                       help="with --tp: norms and dropout on 1/tp of the sequence (all-gather / reduce-scatter)")
    train.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    train.add_argument("--smp", metavar="JSON", default=None,
                       help="SageMaker model-parallel keys (the estimator's parameters dict, or its whole "
                            "distribution dict) as inline JSON or a JSON file; flags given explicitly win "
                            "(docs/sagemaker.md)")
    train.add_argument("--plan", choices=("auto",), default=None,
                       help="auto: the planner picks the layout (every axis and saver of paratrain.config.layout) "
                            "for the processes at hand and prints why; layout settings given are kept (on a CPU "
                            "without a profile it measures this machine once first)")
    train.add_argument("--data-path", nargs="+", default=None, metavar="W SOURCE",
                       help="a weighted mixture, Megatron's spelling: --data-path 0.3 A 0.7 B (weights normalised; "
                            "each source a Megatron prefix split by --split, or a token folder); docs/data.md")
    train.add_argument("--no-memory-check", dest="memory_check", action="store_false", default=None,
                       help="launch even when the planner predicts the layout will not fit in memory")
    train.add_argument("--keep-params", dest="reshard_after_forward", action="store_false", default=None,
                       help="ZeRO-3: keep a unit's gathered parameters from forward to backward")
    train.add_argument("--expert-tp", dest="expert_tp", action="store_true", default=None,
                       help="expert tensor parallelism: cut every expert's matrices over tp (each tp rank holds and "
                            "runs 1/tp of each expert) instead of replicating the experts over tp")
    train.add_argument("--keep-grads", dest="keep_grads", action="store_true", default=None,
                       help="keep the gradient buffers between steps (zeroed) instead of releasing them after "
                            "each update: no allocation per step, the gradients' bytes held between steps")
    worker = commands.add_parser("worker")  # no help: not listed, the launcher starts it
    worker.add_argument("--run-plan", required=True, metavar="FILE", help="the run the launcher resolved (JSON)")
    worker.add_argument("--attempt", type=int, default=0, help="the launch's attempt: 0 the first, K a relaunch")
    worker.add_argument("--flight-dir", default="", help="where this worker leaves its flight record")
    group = commands.add_parser("replica-group")  # no help: the fault-tolerant launcher starts one per group
    group.add_argument("--run-plan", required=True, metavar="FILE", help="the group's run, resolved (JSON)")
    add_tool_commands(commands)
    from paratrain.planner.command import add_arguments

    from paratrain.scaling import add_arguments as scaling_arguments

    scaling_arguments(commands.add_parser(
        "scaling", help="accuracy and wall time against processes: fixed device batch, fixed global batch, scaled lr"))
    add_arguments(commands.add_parser("plan", help="predict per-device memory and step time of layouts, best first"))
    return parser


# arguments of `paratrain train` outside TRAIN_FLAGS (its switches) -> config path
OTHER_ARGS = {"seed": "seed", "recompute": "train.recompute", "compile": "train.compile",
               "check_collectives": "train.check_collectives", "sequence_parallel": "parallel.sequence_parallel",
               "progress": "train.progress", "reshard_after_forward": "parallel.reshard_after_forward",
               "memory_check": "launch.memory_check", "keep_grads": "parallel.keep_grads",
               "expert_tp": "parallel.expert_tp", "data_path": "data.path",
               "plan": "launch.plan"}


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of `paratrain train`'s arguments: defaults < --config TOML < SLURM's variables < --smp <
    flags given."""
    table = load_toml(args.config) if args.config else None
    from paratrain.launch.slurm import slurm_overrides

    overrides: dict[str, Any] = slurm_overrides(os.environ)  # under srun; flags below win
    if getattr(args, "smp", None):  # SageMaker model-parallel keys; explicit flags below win
        from paratrain.config.sagemaker import read_smp, smp_overrides

        overrides.update(smp_overrides(read_smp(args.smp)))
    for attribute, path in ARGUMENT_PATHS.items():
        value = getattr(args, attribute)
        if value is not None:
            overrides[path] = value
    return build_run_config(table, overrides)


ARGUMENT_PATHS = {**{flag.lstrip("-").replace("-", "_"): path for flag, (path, _, _) in TRAIN_FLAGS.items()},
                  **OTHER_ARGS}
"""`paratrain train`'s argparse attribute -> the config path it sets."""


def given_paths(args: argparse.Namespace) -> set[str]:
    """The config paths `paratrain train`'s flags and its --config TOML set explicitly (--plan auto's pins)."""
    paths = {path for attribute, path in ARGUMENT_PATHS.items() if getattr(args, attribute) is not None}
    table = load_toml(args.config) if args.config else {}
    paths |= {f"{section}.{key}" for section, keys in table.items() if isinstance(keys, dict) for key in keys}
    return paths
