from __future__ import annotations

import json

import pytest
import torch

from paratrain.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint


def _state():
    return {
        "model": {"w": torch.randn(3, 4), "n": torch.ones(4)},
        "optimizer": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}, "n": {"note": 1}},
            "param_groups": [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["w", "n"]}],
        },
    }


def test_round_trip_and_latest(tmp_path):
    state = _state()
    save_checkpoint(tmp_path, 5, state, {"loader": {"epoch": 1, "cursor": 8}})
    save_checkpoint(tmp_path, 10, state, {"loader": {"epoch": 2, "cursor": 0}})
    assert resolve_checkpoint(tmp_path).name == "step_00000010"
    loaded, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 10 and meta["loader"] == {"epoch": 2, "cursor": 0}
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["optimizer"]["state"]["w"]["exp_avg"], state["optimizer"]["state"]["w"]["exp_avg"])
    assert loaded["optimizer"]["state"]["n"] == {"note": 1}
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    old, _ = load_checkpoint(tmp_path / "step_00000005")
    assert torch.equal(old["model"]["n"], state["model"]["n"])


def test_no_pickle_on_disk(tmp_path):
    folder = save_checkpoint(tmp_path, 1, _state(), {})
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    json.loads((folder / "meta.json").read_text())


def test_interrupted_write_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _state(), {})
    import paratrain.checkpoint.io as io

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", explode)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, _state(), {})
    assert resolve_checkpoint(tmp_path).name == "step_00000001"
    load_checkpoint(tmp_path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder"):
        load_checkpoint(tmp_path)


def test_a_damaged_checkpoint_names_its_file_and_the_newest_one_that_verifies(tmp_path):
    from paratrain.checkpoint import CheckpointError, newest_verified

    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(), {})
    cut = tmp_path / "step_00000003" / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[:-7])  # cut short
    with pytest.raises(CheckpointError, match=r"step_00000003/model.safetensors has \d+ bytes, \d+ were written "
                                              r"\(cut short or replaced\); the newest older checkpoint that verifies "
                                              r"is .*step_00000002"):
        load_checkpoint(tmp_path)
    flipped = tmp_path / "step_00000002" / "optimizer.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    flipped.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors does not match the SHA-256 .*step_00000001"):
        load_checkpoint(tmp_path / "step_00000002")
    assert newest_verified(tmp_path).name == "step_00000001"  # what --resume auto takes
    (tmp_path / "step_00000001" / "meta.json").write_text("{")
    assert newest_verified(tmp_path) is None


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _state(), {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert resolve_checkpoint(tmp_path).name == "step_00000005"
