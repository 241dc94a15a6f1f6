"""The trainer stops at a non-finite step naming the step and the newest checkpoint to resume from, and
under --nan-policy skip stops once more steps were skipped than train.nan_skips allows."""

from __future__ import annotations

import dataclasses

import pytest

import paratrain
from paratrain.config import build_run_config, check_run
from paratrain.hybrid import NonFiniteError
from paratrain.train import Trainer


def _trainer(tmp_path, **settings) -> Trainer:
    config = build_run_config(None, {"model.preset": "tiny", "data.seq_len": 32, "data.global_batch": 8,
                                     "train.steps": 4, "train.eval_every": 0, "train.sample_tokens": 0,
                                     "train.progress": False, "train.save": str(tmp_path / "ckpt"),
                                     "train.save_every": 1, **settings})
    return Trainer(check_run(config, 1), paratrain.init(device="cpu"))


def test_stop_names_the_step_and_the_newest_checkpoint(tmp_path):
    trainer = _trainer(tmp_path)
    real = trainer.engine.train_step

    def failing_third(batch, loss_fn):
        if trainer.step == 2:
            raise NonFiniteError(float("nan"), float("nan"), (0,))
        return real(batch, loss_fn)

    trainer.engine.train_step = failing_third  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError, match=r"step 3: the loss \(nan\) .* rank\(s\) \[0\].* newest checkpoint: "
                                                 r".*step_00000002 \(--resume .*ckpt\)"):
        trainer.fit()


def test_skips_stop_past_their_allowance(tmp_path):
    trainer = _trainer(tmp_path, **{"train.nan_policy": "skip", "train.nan_skips": 1})
    real = trainer.engine.train_step

    def always_skipped(batch, loss_fn):
        loss = real(batch, loss_fn)
        trainer.engine.last = dataclasses.replace(trainer.engine.last, skipped=True, non_finite=True)
        return loss

    trainer.engine.train_step = always_skipped  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError, match=r"step 2: 2 non-finite steps skipped, more than train.nan_skips \(1\)"):
        trainer.fit()
