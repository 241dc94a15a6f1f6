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


def test_a_sharded_checkpoint_round_trips_and_refuses_damage(tmp_path):
    """One process: save_sharded / load_sharded restore the model, the optimizer state, the dropout
    step; a damaged rank file or an index that does not cover a tensor is named."""
    import paratrain
    from paratrain.checkpoint import CheckpointError, load_sharded, save_sharded, verify_checkpoint
    from paratrain.config import preset

    def engine():
        model = paratrain.build_gpt(preset("tiny", seq_len=16), seed=1, device="meta")
        return paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.AdamW(ps))

    first, second = engine(), engine()
    batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    for _ in range(2):
        first.train_step(batch, paratrain.lm_loss)
    folder = save_sharded(tmp_path, 2, first.view(), {"loader": {}}, keep_last=1)
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank-00000.safetensors"]
    meta = verify_checkpoint(folder)
    load_sharded(folder, meta, second.view())
    assert second.dropout.step == 2
    whole_first, whole_second = first.state_dict(), second.state_dict()
    for name, tensor in whole_first["model"].items():
        assert torch.equal(tensor, whole_second["model"][name]), name
    for name, values in whole_first["optimizer"]["state"].items():
        for key, value in values.items():
            assert torch.equal(value, whole_second["optimizer"]["state"][name][key]), (name, key)
    assert first.train_step(batch, paratrain.lm_loss) == second.train_step(batch, paratrain.lm_loss)

    rank_file = folder / "rank-00000.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00000.safetensors does not match the SHA-256"):
        verify_checkpoint(folder)
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    index = json.loads((folder / "meta.json").read_text())
    index["tensors"]["norm.weight"]["shape"] = [128]  # more elements than its pieces hold
    (folder / "meta.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the pieces of norm.weight hold 64 of its 128 elements"):
        verify_checkpoint(folder)


def test_a_checkpoint_carries_its_attachments_checked(tmp_path):
    """save_sharded(attachments=): files copied in beside the tensors (an --hf run's config.json and tokenizer, under
    hf/), listed in meta.json with size and SHA-256; a changed or missing one is named by verify_checkpoint."""
    import paratrain
    from paratrain.checkpoint import CheckpointError, save_sharded, verify_checkpoint

    from paratrain.config import preset

    model = paratrain.build_gpt(preset("tiny", seq_len=16), seed=1)
    engine = paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.AdamW(ps))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    folder = save_sharded(tmp_path / "ckpt", 1, engine.view(), {}, attachments={"hf/config.json": tmp_path / "config.json"})
    assert (folder / "hf" / "config.json").read_text() == '{"model_type": "llama"}'
    assert verify_checkpoint(folder)["attachments"]["hf/config.json"]["bytes"] == 23
    (folder / "hf" / "config.json").write_text('{"model_type": "mistra"}')
    with pytest.raises(CheckpointError, match="hf/config.json does not match the size and SHA-256"):
        verify_checkpoint(folder, hint=False)
    (folder / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="hf/config.json is missing"):
        verify_checkpoint(folder, hint=False)


def test_buffers_travel_with_the_state(tmp_path):
    """BatchNorm's running statistics (persistent buffers) are saved and restored by both paths, the
    sharded checkpoint and load_state_dict: a resumed run normalises in eval as the uninterrupted one.
    (Before the one state view, sharded checkpoints held parameters only: a restart reset them.)"""
    import paratrain
    from paratrain.checkpoint import load_sharded, save_sharded, verify_checkpoint

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 6 * 6, 2))
        return paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y, reduction="sum"), y.numel()

    first = engine()
    batch = (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 1, 0]))
    for _ in range(3):
        first.train_step(batch, loss)
    folder = save_sharded(tmp_path, 3, first.view(), {}, keep_last=1)
    for restore in ("sharded", "in memory"):
        second = engine()
        if restore == "sharded":
            load_sharded(folder, verify_checkpoint(folder), second.view())
        else:
            second.load_state_dict(first.state_dict())
        for name, tensor in first.model.state_dict().items():
            assert torch.equal(tensor, second.model.state_dict()[name]), (restore, name)
        assert int(second.model[1].num_batches_tracked) == 3


def test_a_memory_copy_is_checked_against_its_sha256_and_keepers_keep_the_newest_two():
    """paratrain.checkpoint.memory_copies without processes: a keeper keeps each rank's newest KEEP steps, says
    which copy it lacks, and a reader refuses bytes that do not match the SHA-256 written with them."""
    import hashlib

    from safetensors.torch import save as to_bytes

    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint.memory_copies import KEEP, Keeper, MemoryReader, _ask

    key = b"k" * 32
    keeper = Keeper("127.0.0.1", key)
    data = to_bytes({"w": torch.arange(6.0)})
    try:
        for step in (1, 2, 3):
            _ask(keeper.address, key, "put", 0, step, ({}, {}, {}, []), {"world": 1, "meta": {}}, data)
        assert KEEP == 2 and _ask(keeper.address, key, "inventory") == {2: [0], 3: [0]}
        with pytest.raises(CheckpointError, match="holds no copy of rank 0's step 1"):
            _ask(keeper.address, key, "file", 0, 1)
        document = {"tensors": {"w": {"shape": [6], "dtype": "float32", "pieces": []}},
                    "files": {"rank-00000.safetensors": {"sha256": hashlib.sha256(data).hexdigest()}}}
        reader = MemoryReader(document, {"rank-00000.safetensors": keeper.address}, key, 3)
        assert torch.equal(reader.read("rank-00000.safetensors", "w", 2, 5), torch.tensor([2.0, 3.0, 4.0]))
        document["files"]["rank-00000.safetensors"]["sha256"] = "0" * 64
        with pytest.raises(CheckpointError, match="does not match the SHA-256 written with it"):
            MemoryReader(document, {"rank-00000.safetensors": keeper.address}, key, 3).read(
                "rank-00000.safetensors", "w", 0, 6)
    finally:
        keeper.close()
