"""Every invalid setting is refused with the rule, the numbers and a fix; TOML and flags compose."""

from __future__ import annotations

import re

import pytest
import torch

from paratrain.config import ConfigError, ParallelConfig, batch_layout, build_run_config, check_run, preset
from paratrain.config.load import from_dict, to_dict


def test_dp_fills_the_world():
    assert ParallelConfig().resolved(4).dp == 4
    assert ParallelConfig(dp=2).resolved(2).world_size == 2


@pytest.mark.parametrize("config,world,needle", [
    (ParallelConfig(dp=3), 4, "dp x tp x pp = 3 x 1 x 1 = 3 must equal the world size (4)"),
    (ParallelConfig(sequence_parallel=True), 4, "sequence_parallel splits the sequence over the tp ranks, and tp is 1"),
    (ParallelConfig(pp=2, zero=3), 4, "use zero 1 or 2 with pp > 1"),
    (ParallelConfig(pp=2, schedule="pipedream"), 4, "schedule must be one of gpipe, 1f1b, interleaved, zero-bubble"),
    (ParallelConfig(virtual_stages=2), 4, "virtual_stages and pp_split cut the model into pipeline stages, and pp is 1"),
    (ParallelConfig(ep=3), 4, "ep (3) must divide dp (4): expert parallelism divides the experts among dp ranks; "
                              "choose ep in [1, 2, 4]"),
    (ParallelConfig(dp=4, shard_group=2), 4, "needs a ZeRO stage"),
    (ParallelConfig(dp=4, zero=1, shard_group=3), 4, "shard_group (3) must divide dp (4): each group of that many dp "
                                                      "ranks holds one copy of the state; choose shard_group in [1, 2, 4]"),
    (ParallelConfig(zero=1, grad_reduce="ring"), 4, "grad_reduce must be"),
    (ParallelConfig(offload="optimizer"), 2, "offload=optimizer needs a ZeRO stage"),
    (ParallelConfig(zero=1, offload="nvme"), 2, "offload must be 'none', 'optimizer', 'activations'"),
    (ParallelConfig(zero=5), 4, "zero must be one of 0, 1, 2, 3"),
    (ParallelConfig(bucket_mb=0), 2, "bucket_mb must be > 0"),
    (ParallelConfig(dp=0), 2, "dp must be >= 1"),
    (ParallelConfig(cp=4, cp_mode="usp", cp_ulysses=3), 4, "cp_ulysses (3) must divide cp (4) and lie between them; "
                                                           "choose cp_ulysses in [2]"),
    (ParallelConfig(cp=4, cp_mode="usp"), 4, "choose cp_ulysses in [2]"),
    (ParallelConfig(cp=2, cp_mode="usp", cp_ulysses=2), 2, "so cp must be a product of two such (4, 6, 8, ...): use "
                                                           "cp_mode ring or ulysses at cp 2"),
    (ParallelConfig(cp=4, cp_ulysses=2), 4, "cp_ulysses (2) is the Ulysses degree inside cp_mode usp, and cp_mode is "
                                            "'ring': set cp_mode usp, or drop cp_ulysses"),
    (ParallelConfig(cp=2, cp_balance="tokens"), 2, "cp_balance must be one of positions, documents, got 'tokens'"),
])
def test_parallel_rules(config, world, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config.resolved(world)


def test_accumulation_must_be_integer():
    assert batch_layout(32, 4, 2).accumulation == 4
    assert batch_layout(32, 0, 2).micro_batch == 16
    with pytest.raises(ConfigError) as info:
        batch_layout(32, 3, 2)
    message = str(info.value)
    assert "32 / (3 x 2)" in message and "5.33" in message and "choose micro_batch in [1, 2, 4, 8, 16]" in message
    with pytest.raises(ConfigError, match=r"global_batch \(33\) must be divisible by dp \(2\).*\[32, 34\]"):
        batch_layout(33, 0, 2)


def test_model_rules():
    with pytest.raises(ConfigError, match=r"n_head \(3\) must divide model.d_model \(64\)"):
        preset("tiny", n_head=3)
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        preset("huge")
    tiny = preset("tiny")
    assert tiny.n_layer >= 4 and tiny.n_head % 4 == 0 and tiny.d_model % 4 == 0 and tiny.ff_dim % 4 == 0
    assert tiny.dropout == 0.0


def test_gpt2_parameter_count():
    # 124M in the GPT-2 paper counts biases and LayerNorm betas; without them: 123.55M, plus the
    # 47 padding rows of the vocabulary (50257 -> 50304) x 768
    gpt2 = preset("gpt2")
    assert gpt2.padded_vocab == 50304 and preset("gpt2", vocab_multiple=1).padded_vocab == 50257
    assert abs(gpt2.num_params() - 47 * 768 - 123.55e6) < 0.01e6


@pytest.mark.parametrize("overrides,world,needle", [
    ({"parallel.tp": 3}, 3, r"tp \(3\) must divide the attention heads \(n_head = 4\).*choose tp in \[1, 2, 4\]"),
    ({"parallel.tp": 2, "model.overrides": {"n_head": 2, "d_ff": 129}}, 2, r"tp \(2\) must divide the MLP width \(ff_dim = 129\)"),
    ({"parallel.tp": 2, "model.overrides": {"vocab_size": 257}}, 2,
     r"vocab_size 257 rounded up to a multiple of vocab_multiple \(1\) is 257.*vocab_multiple = 2 \(pads to 258"),
    ({"parallel.tp": 4, "parallel.sequence_parallel": True, "data.seq_len": 30}, 4,
     r"seq_len \(30\) is not a multiple of it: set data.seq_len to 28 or 32"),
])
def test_tensor_parallel_rules(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle):
        check_run(build_run_config(None, overrides), world)
    # the fix each message names is accepted
    assert check_run(build_run_config(None, {"parallel.tp": 2, "model.overrides": {"vocab_size": 257, "vocab_multiple": 2}}), 2)


@pytest.mark.parametrize("overrides,world,needle", [
    ({"data.global_batch": 30, "data.micro_batch": 4}, 2, "is not an integer"),
    ({"data.seq_len": 4096}, 2, "must be <= the model's seq_len"),
    ({"train.precision": "fp4"}, 2, "precision must be one of fp32, bf16, fp16, fp8"),
    ({"train.precision": "fp8", "parallel.tp": 8, "parallel.tp_mode": "3d"}, 8, "precision fp8 under tp_mode 3d"),
    ({"train.precision": "fp8", "train.fp8_recipe": "blockwise"}, 1, "fp8_recipe must be one of tensorwise, rowwise"),
    ({"train.steps": 0}, 2, "train.steps must be >= 1"),
    ({"optim.lr": -1.0}, 2, "optim.lr must be > 0"),
    ({"data.batch_rampup": "4,4,100", "data.global_batch": 16}, 2, "needs an explicit --micro-batch"),
    ({"data.batch_rampup": "4,5,100", "data.global_batch": 16, "data.micro_batch": 2}, 2, "whole number of INCREMENT"),
    ({"data.batch_rampup": "2,2,100", "data.global_batch": 16, "data.micro_batch": 2}, 2,
     "passes through a global batch of 2: .* not an integer"),
    ({"optim.optimizer": "lion"}, 2, r"optim.optimizer must be one of \('adamw', 'muon', 'sgd'\)"),
    ({"optim.lr_schedule": "step"}, 2, "optim.lr_schedule must be one of"),
    ({"optim.decay_fraction": 0.0}, 2, r"optim.decay_fraction must be in \(0, 1\]"),
    ({"optim.optimizer": "muon", "optim.muon_momentum": 1.0}, 2, r"muon_momentum must be in \[0, 1\)"),
    ({"optim.optimizer": "muon", "optim.muon_ns_steps": 0}, 2, "muon_ns_steps must be in"),
    ({"optim.optimizer": "muon", "optim.muon_ns_dtype": "fp8"}, 2, "muon_ns_dtype must be"),
    ({"optim.optimizer": "muon", "optim.muon_adjust_lr": "x"}, 2, "muon_adjust_lr must be"),
    ({"optim.optimizer": "muon", "optim.muon_exclude": "("}, 2, "is not a regular expression"),
    ({"optim.optimizer": "muon", "parallel.ps_mode": "sync"}, 2, "Muon needs each whole matrix"),
    ({"launch.nnodes": 2}, 4, "needs --rdzv-endpoint"),
    ({"launch.node_rank": 3}, 2, r"node_rank \(3\) must be in 0..0"),
    ({"parallel.dp": 4}, 2, "must equal the world size"),
    ({"model.preset": "tiny", "parallel.pp": 2, "parallel.pp_layout": "Et*2|t*3L"}, 2,
     r"covers 7 layers and the model has 6 \(the embedding, 4 blocks, the head for the GPT\): write every layer once"),
    ({"model.preset": "tiny", "parallel.pp": 2, "parallel.pp_layout": "Et*2|t*2L|t"}, 2,
     r"writes 3 chunks \(2 borders '\|'\) and the pipeline has pp x virtual_stages = 2"),
    ({"model.preset": "tiny", "parallel.pp": 2, "parallel.pp_layout": "Et*2|t*2L", "parallel.pp_split": (3,)}, 2,
     "both cut the pipeline: give one"),
    ({"model.preset": "tiny", "parallel.pp": 2, "parallel.pp_layout": "Et*2|t*2mL"}, 2,
     r"writes 1 MTP depths \(m\) and the model has 0"),
    ({"model.preset": "tiny", "parallel.cp": 8, "parallel.cp_mode": "usp", "parallel.cp_ulysses": 8 // 2,
      "parallel.tp": 2}, 16, r"n_head / tp = 2 % cp_ulysses \(4\) must be 0; choose --cp-ulysses in \[2\]"),
    ({"model.preset": "tiny", "model.overrides.dropout": 0.1, "model.overrides.mtp_depth": 1, "parallel.cp": 2,
      "parallel.cp_balance": "documents"}, 2, r"cp_balance documents splits each micro-batch by its documents, and "
     r"dropout 0.1, mtp_depth 1 read each token's window position from the fixed split"),
    ({"train.fail_at": "x"}, 2, "RANK:STEP"),
    ({"launch.nnodes": 2, "launch.min_nodes": 3, "launch.rdzv_endpoint": "h:1"}, 4, r"min_nodes \(3\) must be in 1..nnodes"),
    ({"launch.nnodes": 2, "launch.min_nodes": 1, "launch.rdzv_endpoint": "h:1"}, 4, "needs --rdzv-backend c10d"),
    ({"launch.nnodes": 2, "launch.min_nodes": 1, "launch.rdzv_endpoint": "h:1", "launch.rdzv_backend": "c10d"}, 4,
     "give --max-restarts"),
    ({"launch.nnodes": 2, "launch.min_nodes": 1, "launch.rdzv_endpoint": "h:1", "launch.rdzv_backend": "c10d",
      "launch.max_restarts": 1, "train.save": "/tmp/ckpt", "parallel.dp": 4}, 4, "drop --dp 4"),
    ({"train.memory_copies": 1, "train.save": "/tmp/ckpt", "launch.nnodes": 2, "launch.rdzv_endpoint": "h:1"}, 4,
     "give --save DIR --save-mode async"),
    ({"train.memory_copies": 1, "train.save": "/tmp/ckpt", "train.save_mode": "async"}, 2,
     r"the job has 1 node\(s\) \(--nnodes\): a copy on its own node dies with it"),
    ({"train.memory_copies": -1}, 2, "memory_copies must be >= 0"),
])
def test_run_rules(overrides, world, needle):
    with pytest.raises(ConfigError, match=needle):
        check_run(build_run_config(None, overrides), world)


def test_pp_layout_becomes_the_runs_pp_split():
    """`--pp-layout` in Megatron's spelling is the run's pp_split for the model (E, the blocks, L), V schedules
    counting their two chunks a rank; the spelling's rules (paratrain.config.pp_layout) each refused by name."""
    from paratrain.config.pp_layout import layout_split

    base = {"model.preset": "tiny", "data.global_batch": 8, "data.micro_batch": 2}
    plan = check_run(build_run_config(None, {**base, "parallel.pp": 2, "parallel.pp_layout": "E|t*4L"}), 2)
    assert plan.parallel.pp_split == (1,) and not plan.parallel.pp_layout
    plan = check_run(build_run_config(None, {**base, "parallel.pp": 2, "parallel.schedule": "zb-v",
                                             "parallel.pp_layout": "Et|t|t|tL"}), 2)
    assert plan.parallel.pp_split == (2, 3, 4) and plan.parallel.virtual_stages == 2
    assert layout_split("Et|(tt|)*5tL", 14) == (2, 4, 6, 8, 10, 12)
    assert layout_split("Et*2|t*2mmL", 6, mtp_depth=2) == (3,)
    for spec, rule in (("E||tL", "chunk 1 holds no layer"), ("tEL", "E \\(the embedding\\) can only be the first"),
                       ("Etm|tL", "write them just before L, in its chunk"), ("Ex|L", "found \\['x'\\]")):
        with pytest.raises(ConfigError, match=rule):
            layout_split(spec, 3)


def test_unknown_and_mistyped_settings():
    with pytest.raises(ConfigError, match="unknown setting 'data.globl_batch'"):
        build_run_config(None, {"data.globl_batch": 3})
    with pytest.raises(ConfigError, match="unknown config section 'trian'"):
        build_run_config({"trian": {"steps": 3}})
    with pytest.raises(ConfigError, match="data.global_batch must be an integer"):
        build_run_config({"data": {"global_batch": "many"}})
    with pytest.raises(ConfigError, match="must be true or false"):
        build_run_config({"train": {"compile": 1}})
    with pytest.raises(ConfigError, match="train.recompute must be a string"):
        build_run_config({"train": {"recompute": True}})
    with pytest.raises(ConfigError, match="parallel.dp must be an integer"):
        build_run_config(None, {"parallel.dp": "2"})
    assert build_run_config(None, {"parallel.dp": None}).parallel.dp is None
    with pytest.raises(ConfigError, match="is a section"):
        build_run_config({"data": "builtin"})
    assert build_run_config(None, {"optim.lr": 1}).optim.lr == 1
    with pytest.raises(ConfigError, match=r"unknown model setting\(s\) \['n_layers'\]"):
        check_run(build_run_config({"model": {"n_layers": 2}}), 1)


def test_process_count_follows_dp():
    from paratrain.config import launch_world_size

    def world(gpus: int = 0, **settings) -> int:
        return launch_world_size(build_run_config(None, settings), gpus=gpus)

    assert world() == 2
    assert world(**{"parallel.dp": 4}) == 4
    assert world(**{"parallel.dp": 4, "launch.nproc": 2}) == 2
    # the layout's whole world: cp ranks and dedicated parameter servers too (dp 2 x cp 2 once started 2)
    assert world(**{"parallel.dp": 2, "parallel.cp": 2}) == 4
    assert world(**{"parallel.dp": 2, "parallel.ps_mode": "sync", "parallel.ps_servers": 1}) == 3
    assert world(**{"launch.nproc": 3, "launch.nnodes": 2}) == 6
    with pytest.raises(ConfigError, match="do not split evenly over 2 nodes"):
        world(**{"parallel.dp": 3, "launch.nnodes": 2})


def test_devices_are_explicit():
    """On CUDA the default process count is the visible GPUs; more processes than GPUs per node under
    NCCL is refused before launch (a machine with one GPU once launched 2 and lost rank 1 to
    'invalid device ordinal'). The CPU takes any count."""
    from paratrain.config import launch_world_size, resolve_device

    def world(gpus: int, **settings) -> int:
        return launch_world_size(build_run_config(None, settings), gpus=gpus)

    assert resolve_device("auto", gpus=0) == "cpu" and resolve_device("auto", gpus=1) == "cuda"
    assert resolve_device("cpu", gpus=8) == "cpu"
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU on this node"):
        resolve_device("cuda", gpus=0)
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_device("tpu", gpus=0)
    assert world(1) == 1 and world(8) == 8  # the README's main job on a one-GPU machine: one process
    assert world(8, **{"launch.nnodes": 2}) == 16
    assert world(1, **{"launch.device": "cpu"}) == 2 and world(1, **{"launch.device": "cpu", "launch.nproc": 4}) == 4
    with pytest.raises(ConfigError, match=r"2 processes per node on CUDA need 2 GPUs .* sees 1: start at most 1 "
                                          r"per node \(--nproc 1.*or train on the CPU with --device cpu"):
        world(1, **{"launch.nproc": 2})
    with pytest.raises(ConfigError, match="4 processes per node on CUDA need 4 GPUs"):
        world(2, **{"parallel.dp": 2, "parallel.tp": 2})
    assert world(4, **{"parallel.dp": 2, "parallel.tp": 2, "launch.nnodes": 2}) == 4
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU"):
        world(0, **{"launch.device": "cuda"})
    with pytest.raises(ConfigError, match="device must be one of"):
        check_run(build_run_config(None, {"launch.device": "gpu"}), 1)
    import paratrain

    assert paratrain.init(device="cpu").device.type == "cpu"
    with pytest.raises(ConfigError, match="device must be one of"):
        paratrain.init(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA GPU"):
            paratrain.init(device="cuda")


def test_toml_then_flags(tmp_path):
    from paratrain.config import load_toml

    path = tmp_path / "run.toml"
    path.write_text('seed = 5\n[model]\npreset = "tiny"\nn_layer = 2\n[data]\nglobal_batch = 8\n[train]\nsteps = 3\n')
    config = build_run_config(load_toml(path), {"train.steps": 7})
    assert config.seed == 5 and config.model.preset == "tiny" and config.model.overrides == {"n_layer": 2}
    assert config.data.global_batch == 8 and config.train.steps == 7
    plan = check_run(config, 1)
    assert plan.model.n_layer == 2 and plan.seq_len == 64
    assert to_dict(from_dict(to_dict(config))) == to_dict(config)


def test_bad_toml(tmp_path):
    from paratrain.config import load_toml

    (tmp_path / "bad.toml").write_text("[data\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_toml(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


def test_every_node_count_down_to_min_nodes_is_checked_before_launch(capsys):
    """3 processes per node and tp 2: 2 nodes make dp 3, but one node alone (3 processes) cannot hold tp
    2, so --min-nodes 1 is refused before anything starts; --min-nodes 2 is not."""
    from paratrain.cli.flags import build_parser, run_config_from_args
    from paratrain.cli.launching import prepare_launch

    flags = ["train", "--device", "cpu", "--nproc", "3", "--nnodes", "2", "--tp", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:1", "--max-restarts", "1", "--save", "/tmp/paratrain-min-nodes",
             "--global-batch", "12", "--no-memory-check"]
    with pytest.raises(ConfigError, match=r"with 1 of 2 nodes \(--min-nodes 1\): tp x pp = 2 x 1 = 2 must divide"):
        prepare_launch(run_config_from_args(build_parser().parse_args([*flags, "--min-nodes", "1"])), gpus=0)
    assert prepare_launch(run_config_from_args(build_parser().parse_args([*flags, "--min-nodes", "2"])), gpus=0)


def test_the_run_file_hands_the_workers_the_resolved_run(tmp_path):
    """What the launcher writes (paratrain.config.write_run) is what each worker reads back: every section,
    tuples, None, model overrides and the launcher's own settings, equal to the run it resolved."""
    from paratrain.config import read_run, write_run

    config = build_run_config({"model": {"preset": "tiny", "n_experts": 4, "capacity_factor": 1.25}},
                              {"parallel.pp": 2, "parallel.pp_split": (2,), "parallel.zero": 1,
                               "parallel.shard_group": 2, "parallel.bucket_mb": 0.5, "data.micro_batch": 2, "train.recompute": "selective",
                               "launch.nproc": 4, "launch.plan": "auto", "seed": 7})
    assert read_run(write_run(config, tmp_path / "run.json")) == config
    with pytest.raises(ConfigError, match="run file .* does not exist"):
        read_run(tmp_path / "missing.json")


@pytest.mark.parametrize("overrides,world,needle", [
    ({"parallel.expert_tp": True}, 2, "expert_tp cuts every expert over the tp ranks, and tp is 1: set tp > 1"),
    ({"parallel.tp": 2, "parallel.expert_tp": True}, 2, "--expert-tp splits the experts of a Mixture-of-Experts model "
                                                        "among ranks, and this model is dense: give --experts N"),
    ({"parallel.tp": 2, "parallel.expert_tp": True, "model.preset": "tiny-moe", "model.overrides": {"d_expert": 129}},
     2, "expert_tp cuts each expert's width (129) over tp = 2: it must divide; set d_expert to a multiple of tp"),
])
def test_expert_tensor_parallel_rules(overrides, world, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_run(build_run_config(None, overrides), world)
    assert check_run(build_run_config(None, {"parallel.tp": 2, "parallel.expert_tp": True,
                                             "parallel.sequence_parallel": True, "model.preset": "tiny-moe"}), 2)
