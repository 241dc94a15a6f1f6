"""`paratrain inspect` and `paratrain export` on a checkpoint the trainer wrote."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

import paratrain
from paratrain.cli import main
from paratrain.config import build_run_config, check_run
from paratrain.train import Trainer


def _checkpoint(tmp_path):
    config = build_run_config(None, {"model.preset": "tiny", "data.seq_len": 32, "data.global_batch": 8,
                                     "train.steps": 2, "train.eval_every": 0, "train.sample_tokens": 0,
                                     "train.progress": False, "train.save": str(tmp_path / "ckpt")})
    trainer = Trainer(check_run(config, 1), paratrain.init(device="cpu"))
    trainer.fit()
    return trainer


def test_inspect_and_export(tmp_path, capsys):
    trainer = _checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["step"] == 2 and record["world_size"] == 1 and record["model"]["preset"] == "tiny"
    assert record["params"] == sum(p.numel() for p in trainer.model.parameters())  # tied weights once
    names = {r["name"] for r in record["tensors"]["model.safetensors"]}
    assert "blocks.0.attn.qkv.weight" in names
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "step 2, saved by 1 process(es)" in capsys.readouterr().out

    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--dtype", "bfloat16"]) == 0
    exported = load_file(str(out))
    model = paratrain.build_gpt(trainer.plan.model, seed=0)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in exported.items()}, strict=False)
    assert not unexpected and set(missing) <= {"head.weight"}  # tied to tok_emb.weight
    for name, param in trainer.model.named_parameters():
        assert torch.equal(exported[name], param.detach().bfloat16()), name

    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "nothing" in capsys.readouterr().err
