"""paratrain.Trainer: Lightning's shape (devices, strategy, fit) with paratrain's promise: the same
per-step losses, validation losses and trained weights for any device count and strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, ParallelConfig
from paratrain.fit import Callback, strategy_config
from tests.fit import fit_script
from tests.helpers import max_state_diff, rel_diff
from tests.margins import within

SCRIPT = Path(fit_script.__file__)


def in_process(**options: object) -> tuple[paratrain.FitResult, torch.nn.Module]:
    model, train, val = fit_script.build()
    trainer = paratrain.Trainer(max_steps=6, global_batch=16, micro_batch=4, lr=0.05, val_every=3, **options)
    return trainer.fit(model, fit_script.loss_fn, train, val), model


def as_script(tmp_path: Path, devices: int, strategy: str, *options: str) -> dict:
    out = tmp_path / f"{devices}-{strategy}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(devices), strategy, str(out), *options],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 1, "the code after fit ran in the workers too"
    return json.loads(lines[0])


@pytest.mark.e2e
def test_same_losses_and_weights_for_any_devices_and_strategy(tmp_path):
    """The script launches its own 2 processes; the launching process gets the trained weights."""
    result, model = in_process()
    reference = {"losses": list(result.losses.values()), "val": list(result.val_losses.values()),
                 "model": {k: v for k, v in model.state_dict().items()}}
    assert sorted(result.val_losses) == [0, 3, 6] and len(result.losses) == 6
    for devices, strategy in ((2, "zero3"),):  # tp through the Trainer: the same launch, and tp's own tests
        got = as_script(tmp_path, devices, strategy)
        within(rel_diff(list(got["losses"].values()), reference["losses"]), 1e-12, f"loss {strategy} (float64)")
        within(rel_diff(list(got["val_losses"].values()), reference["val"]), 1e-12, f"val loss {strategy} (float64)")
        weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["model"].items()}
        within(max_state_diff(weights, reference["model"]), 1e-12, f"trained weights {strategy} (float64)")


@pytest.mark.e2e
def test_muon_by_name_gives_the_same_fit_under_zero3(tmp_path):
    """Trainer(optimizer="muon"): Muon on the two Linear weights, AdamW on the biases; 2 devices under ZeRO-3 equal
    one (float64; torch's bfloat16 Newton-Schulz, fed the same bits in both)."""
    result, model = in_process(optimizer="muon")
    got = as_script(tmp_path, 2, "zero3", 'optimizer="muon"')
    within(rel_diff(list(got["losses"].values()), list(result.losses.values())), 1e-12, "loss Muon zero3 (float64)")
    weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["model"].items()}
    within(max_state_diff(weights, dict(model.state_dict())), 1e-12, "trained weights Muon zero3 (float64)")
    adamw, _ = in_process()
    assert list(result.losses.values())[-1] != list(adamw.losses.values())[-1]  # Muon is what ran


@pytest.mark.e2e
def test_an_iterable_dataset_gives_the_same_fit_on_two_devices(tmp_path):
    """fit over an IterableDataset (its own order): 2 devices under ZeRO-2 read the same global batches as one and
    give the same losses and weights (float64, 1e-12)."""
    model, train, val = fit_script.build()
    trainer = paratrain.Trainer(max_steps=6, global_batch=16, micro_batch=4, lr=0.05, val_every=3)
    result = trainer.fit(model, fit_script.loss_fn, fit_script.Stream(train), val)
    got = as_script(tmp_path, 2, "zero2", "stream=true")
    within(rel_diff(list(got["losses"].values()), list(result.losses.values())), 1e-12, "loss stream zero2 (float64)")
    weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["model"].items()}
    within(max_state_diff(weights, dict(model.state_dict())), 1e-12, "trained weights stream zero2 (float64)")


@pytest.mark.e2e
def test_a_failed_worker_is_relaunched_and_the_fit_continues_exactly(tmp_path):
    """max_restarts: rank 1 fails at the end of step 4 of 6 in the first launch, before that step's
    checkpoint; the job is launched again, resumes from the checkpoint of step 2 and ends with one
    process's losses and weights (float64)."""
    result, model = in_process()
    ckpt = json.dumps(str(tmp_path / "ckpt"))
    got = as_script(tmp_path, 2, "ddp", f"save={ckpt}", "save_every=2", "max_restarts=1", "fail_once_after=4",
                    f"log_json={json.dumps(str(tmp_path / 'log.jsonl'))}")
    assert sorted(int(s) for s in got["losses"]) == [3, 4, 5, 6]  # the relaunch's steps
    within(rel_diff(list(got["losses"].values()), [result.losses[s] for s in (3, 4, 5, 6)]), 1e-12,
           "loss after the relaunch (float64)")
    weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["model"].items()}
    within(max_state_diff(weights, model.state_dict()), 1e-12, "weights after the relaunch (float64)")
    steps = [r["step"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step logged once across both launches


@pytest.mark.e2e
def test_a_lost_replica_group_costs_the_fit_a_step(tmp_path):
    """Trainer(fault_tolerance="replica", replica_groups=2) on 4 devices under ZeRO-2: each group of 2 launched as a
    job of its own; rank 1 of group 1 SIGKILLed after step 3 of 6. Group 0 redoes step 4 alone, the fit returns its
    result in the launching process, and the losses and weights are one process's (float64)."""
    result, model = in_process()
    done = subprocess.run([sys.executable, str(SCRIPT), "4", "zero2", str(tmp_path / "out.json"),
                           'fault_tolerance="replica"',
                           "kill_group_rank_after=[1, 1, 3]"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replica group(s) [1] were lost; the others finished the run" in done.stderr, done.stderr[-3000:]
    assert "lost at step 4; the step was redone by [0]" in done.stderr, done.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    within(rel_diff(list(got["losses"].values()), list(result.losses.values())), 1e-12, "loss, a group lost (float64)")
    within(rel_diff(list(got["val_losses"].values()), list(result.val_losses.values())), 1e-12,
           "val loss, a group lost (float64)")
    weights = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["model"].items()}
    within(max_state_diff(weights, dict(model.state_dict())), 1e-12, "weights, a group lost (float64)")


def test_resume_continues_exactly(tmp_path):
    whole, _ = in_process()
    model, train, val = fit_script.build()
    paratrain.Trainer(max_steps=3, global_batch=16, micro_batch=4, lr=0.05, save=str(tmp_path / "ckpt")).fit(
        model, fit_script.loss_fn, train)
    resumed, _ = in_process(save=str(tmp_path / "ckpt"), resume="auto")
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: whole.losses[s] for s in (4, 5, 6)}
    assert 3 not in resumed.losses


def test_callbacks_logs_and_tensorboard(tmp_path):
    seen: list[tuple[str, int]] = []

    class Collect(Callback):
        def on_fit_start(self, trainer):
            seen.append(("start", trainer.step))

        def on_train_step_end(self, trainer, record):
            seen.append(("step", record["step"]))

        def on_validation_end(self, trainer, step, val_loss):
            seen.append(("val", step))

        def on_fit_end(self, trainer, result):
            seen.append(("end", len(result.losses)))

    result, _ = in_process(callbacks=[Collect(), paratrain.fit.PrintProgress(every=3)],
                           log_json=str(tmp_path / "log.jsonl"), tensorboard=str(tmp_path / "tb"))
    assert seen == [("start", 0), ("val", 0), ("step", 1), ("step", 2), ("val", 3), ("step", 3), ("step", 4),
                    ("step", 5), ("val", 6), ("step", 6), ("end", 6)]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if "loss" in r] == list(result.losses.values())
    assert any("memory" in r for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(list(result.losses.values()))
    assert [e.step for e in events.Scalars("val/loss")] == [0, 3, 6]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(events.Tags()["scalars"])


def test_strategies_map_to_layouts():
    assert strategy_config("ddp", devices=4, tp=None, pp=None) == ParallelConfig()
    assert strategy_config("fsdp", devices=4, tp=None, pp=None) == ParallelConfig(zero=3)
    assert strategy_config("zero2", devices=4, tp=None, pp=None) == ParallelConfig(zero=2)
    assert strategy_config("tp", devices=4, tp=None, pp=None) == ParallelConfig(tp=4)
    assert strategy_config("3d", devices=8, tp=2, pp=2) == ParallelConfig(tp=2, pp=2)
    with pytest.raises(ConfigError, match="needs the tensor and pipeline degrees"):
        strategy_config("3d", devices=8, tp=2, pp=None)
    with pytest.raises(ConfigError, match="is not one of ddp"):
        strategy_config("deepspeed", devices=2, tp=None, pp=None)
    with pytest.raises(ConfigError, match="data parallel; tp= and pp= need"):
        strategy_config("zero1", devices=2, tp=2, pp=None)


def test_bad_settings_are_refused_with_the_rule():
    with pytest.raises(ConfigError, match="must be divisible by dp"):
        paratrain.Trainer(devices=4, max_steps=1, global_batch=6)
    with pytest.raises(ConfigError, match="micro_batch in"):
        paratrain.Trainer(devices=2, max_steps=1, global_batch=8, micro_batch=3)
    with pytest.raises(ConfigError, match="master='host:port'"):
        paratrain.Trainer(devices=2, num_nodes=2, max_steps=1, global_batch=8)
    with pytest.raises(ConfigError, match="does not start dedicated parameter servers"):
        paratrain.Trainer(devices=3, max_steps=1, global_batch=8,
                          strategy=ParallelConfig(ps_mode="sync", ps_servers=1))
    with pytest.raises(ConfigError, match="save_mode must be 'sync' or 'async'"):
        paratrain.Trainer(devices=2, max_steps=1, global_batch=8, save_mode="later")
    with pytest.raises(ConfigError, match="parameter servers .* write their own slices"):
        paratrain.Trainer(devices=2, max_steps=1, global_batch=8, save_mode="async",
                          strategy=ParallelConfig(ps_mode="sync"))
    model, train, _ = fit_script.build()
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        paratrain.Trainer(max_steps=1, global_batch=128).fit(model, fit_script.loss_fn, train)
    with pytest.raises(TypeError, match="must return a scalar tensor"):
        paratrain.Trainer(max_steps=1, global_batch=16).fit(model, lambda m, b: m(b[0]), train)


def test_a_layout_the_model_cannot_take_is_refused_before_any_process_starts():
    """The launching process holds the model: tp without a plan, a plan naming modules it lacks, a tie a pipeline
    would split across tp alike: a ConfigError there, at once, no worker started (before, two workers died
    with a ValueError each and the caller got a FileNotFoundError for the result file)."""
    import time

    from paratrain.models.hf import LLAMA_TP_PLAN
    from tests.zoo import build as build_zoo

    model, train, _ = fit_script.build()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="tp = 2 needs a tensor-parallel plan"):
        paratrain.Trainer(devices=2, strategy="tp", max_steps=1, global_batch=16).fit(model, fit_script.loss_fn, train)
    with pytest.raises(ConfigError, match="matches no module of the model"):
        paratrain.Trainer(devices=2, strategy="tp", tp_plan={"attn.qkv": "column"}, max_steps=1,
                          global_batch=16).fit(model, fit_script.loss_fn, train)
    with pytest.raises(ConfigError, match="precision fp8 makes the linears of a model's blocks float8"):
        paratrain.Trainer(devices=2, precision="fp8", max_steps=1, global_batch=16).fit(model, fit_script.loss_fn,
                                                                                         train)
    assert time.perf_counter() - start < 2.0  # measured 0.01 s
    with pytest.raises(ConfigError, match="matches no module of the model"):
        paratrain.Trainer(devices=2, strategy="tp", tp_plan=LLAMA_TP_PLAN, max_steps=1,
                          global_batch=16).fit(build_zoo("gpt2"), fit_script.loss_fn, train)


@pytest.mark.e2e
def test_two_nodes_each_launching_its_worker(tmp_path):
    """num_nodes=2 on 127.0.0.1 (MASTER_ADDR, MASTER_PORT, NODE_RANK as Lightning reads them): both
    launching processes get the result and the trained weights; the losses are one process's."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, str(SCRIPT), "1", "ddp", str(tmp_path / f"node{rank}.json"), "num_nodes=2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "NODE_RANK": str(rank)}) for rank in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]
    reference, _ = in_process()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"node{rank}.json").read_text())
        within(rel_diff(list(got["losses"].values()), list(reference.losses.values())), 1e-12,
               "loss, 2 nodes x 1 device (float64)")


@pytest.mark.e2e
def test_a_hugging_face_folder_through_the_trainer_and_back(tmp_path):
    """Trainer(hf=DIR, devices=2, strategy="tp") on a tied Llama whose vocabulary (63) tp 2 pads: the launching
    process gets one process's losses (float32: measured equal to the bit here, bound 1e-5) and save_pretrained writes
    a folder transformers loads with nothing missing, unexpected or mismatched, the vocabulary trimmed back."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.fit import hf_script

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=63, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True, use_cache=False,
                                 attn_implementation="sdpa")).save_pretrained(tmp_path / "llama")
    _, alone = hf_script.fit(str(tmp_path / "llama"), 1, "ddp", str(tmp_path / "one"))
    result = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(Path(hf_script.__file__)), str(tmp_path / "llama"), "2", "tp",
                           str(tmp_path / "ckpt"), str(tmp_path / "out"), str(result)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = result.read_text().splitlines()
    assert len(lines) == 1, "the code after fit ran in the workers too"
    losses = {int(k): v for k, v in json.loads(lines[0])["losses"].items()}
    within(rel_diff(list(losses.values()), list(alone.losses.values())), 1e-5, "loss tp 2 vs one process (float32)")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.model.embed_tokens.weight.shape[0] == 63 and model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ConfigError, match="without a model"):
        paratrain.Trainer(max_steps=1, global_batch=8, hf=str(tmp_path / "llama")).fit(torch.nn.Linear(1, 1))
