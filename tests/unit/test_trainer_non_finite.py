"""The trainer stops at a non-finite step naming the step and the newest checkpoint to resume from, and
under --nan-policy skip stops once more steps were skipped than train.nan_skips allows."""

from __future__ import annotations

import json

import pytest
import torch

import paratrain
from paratrain.config import build_run_config, check_run
from paratrain.train import Trainer


def _trainer(tmp_path, **settings) -> Trainer:
    config = build_run_config(None, {"model.preset": "tiny", "data.seq_len": 32, "data.global_batch": 8,
                                     "train.steps": 4, "train.eval_every": 0, "train.sample_tokens": 0,
                                     "train.progress": False, "train.save": str(tmp_path / "ckpt"),
                                     "train.save_every": 1, **settings})
    return Trainer(check_run(config, 1), paratrain.init(device="cpu"))


def _poison(trainer: Trainer) -> None:
    """One weight nan: every loss from here on is nan (a real non-finite step, not a simulated one)."""
    with torch.no_grad():
        trainer.model.blocks[0].mlp.up.weight[0, 0] = float("nan")


def test_stop_names_the_step_and_the_newest_checkpoint(tmp_path):
    """The step is queued without a read (Engine.step); the read before the checkpoint at step 3 finds it."""
    trainer = _trainer(tmp_path)
    real = trainer.engine.step

    def poisoned_third(batch, loss_fn, **kwargs):
        if trainer.step == 2:
            _poison(trainer)
        return real(batch, loss_fn, **kwargs)

    trainer.engine.step = poisoned_third  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError, match=r"step 3: the loss \(nan\) .* of step 3 .* rank\(s\) \[0\].* "
                                                 r"newest checkpoint: .*step_00000002 \(--resume .*ckpt\)"):
        trainer.fit()


def test_skips_stop_past_their_allowance(tmp_path):
    trainer = _trainer(tmp_path, **{"train.nan_policy": "skip", "train.nan_skips": 1})
    _poison(trainer)  # a skipped update leaves the nan weight: every step is skipped
    with pytest.raises(FloatingPointError, match=r"step 2: 2 non-finite steps skipped, more than train.nan_skips \(1\)"):
        trainer.fit()


def test_log_every_reads_each_interval_once_and_keeps_every_loss(tmp_path):
    trainer = _trainer(tmp_path, **{"train.log_every": 3, "train.steps": 7, "train.save": "",
                                    "train.log_json": str(tmp_path / "log.jsonl")})
    result = trainer.fit()
    assert sorted(result.losses) == list(range(1, 8))
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [3, 6, 7]
