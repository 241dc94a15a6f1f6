"""Sharded checkpoints: written by every rank, read back under another layout (only the pieces a rank
keeps), a run continues as the uninterrupted single-process one does."""

from __future__ import annotations

import json

import pytest

from tests.helpers import rel_diff, tiny_run
from tests.margins import within

STEPS = 6
_cache: dict = {}


def reference() -> dict:
    if "ref" not in _cache:
        _cache["ref"] = tiny_run(dp=None, micro_batch=None, steps=STEPS, dtype="float64", dropout=0.1)
    return _cache["ref"]


def _job(**kwargs) -> dict:
    return tiny_run(dtype="float64", dropout=0.1, **kwargs)


def _verify(folder: str) -> str | None:
    from paratrain.checkpoint import CheckpointError, verify_shared

    try:
        verify_shared(folder)
    except CheckpointError as error:
        return str(error)
    return None


SAVED = {  # 4 ranks each: ZeRO shards cutting through tensors; tensor slices and pipeline stages
    "dp4-zero3": dict(dp=4, zero=3, micro_batch=4),
    "tp2-pp2-sp": dict(dp=1, tp=2, pp=2, sequence_parallel=True, micro_batch=4),
    "tp4-2d": dict(dp=1, tp=4, tp_mode="2d", micro_batch=4),  # blocks cut two ways
}
LOADED = {
    "pp2-dp2-interleaved": dict(dp=2, pp=2, schedule="interleaved", virtual_stages=2, zero=1, micro_batch=2),
    "tp4-sp": dict(dp=1, tp=4, sequence_parallel=True, micro_batch=4),
    "dp4-zero3": dict(dp=4, zero=3, micro_batch=4),
    "tp4-2d": dict(dp=1, tp=4, tp_mode="2d", micro_batch=4),
}

LOADS = {"dp4-zero3": ["pp2-dp2-interleaved", "tp4-2d"], "tp2-pp2-sp": ["dp4-zero3", "tp4-sp"],
         "tp4-2d": ["tp4-sp"]}  # (ZeRO-3's shards into tp 4 + SP: the pipeline's and the grid's saves cover that load)


@pytest.mark.parametrize("saved", list(SAVED))
def test_sharded_checkpoint_continues_under_other_layouts(pools, tmp_path, saved):
    root = str(tmp_path / "ckpt")
    pools(4).run(_job, steps=STEPS // 2, save_sharded=root, **SAVED[saved])
    meta = json.loads((tmp_path / "ckpt" / "step_00000003" / "meta.json").read_text())
    assert meta["format"] == "paratrain-checkpoint/2" and meta["rng"] == {"dropout_step": 3}
    writers = {piece["file"] for entry in meta["tensors"].values() for piece in entry["pieces"]}
    assert len(writers) == 4  # every rank holds pieces no other rank holds
    ref = reference()["losses"][STEPS // 2:]
    for name in LOADS[saved]:
        got = pools(4).run(_job, steps=STEPS // 2, start_step=STEPS // 2, load_sharded=root, **LOADED[name])
        within(rel_diff(got[0]["losses"], ref), 1e-12, f"loss, saved {saved}, loaded {name} (float64)")
        if name == "dp4-zero3":  # each rank reads its quarter of the values and of the optimizer state
            total = sum(f["bytes"] for f in meta["files"].values())
            assert all(r["bytes_read"] <= 0.3 * total for r in got), [r["bytes_read"] / total for r in got]
    single = tiny_run(dp=None, micro_batch=None, steps=STEPS // 2, start_step=STEPS // 2, load_sharded=root,
                      dtype="float64", dropout=0.1)
    within(rel_diff(single["losses"], ref), 1e-12, f"loss, saved {saved}, loaded in one process (float64)")
    if saved == "dp4-zero3":  # one byte of rank 2's file flipped, its size kept: only its hasher sees it,
        cut = tmp_path / "ckpt" / "step_00000003" / "rank-00002.safetensors"  # and every rank says so
        data = bytearray(cut.read_bytes())
        data[-9] ^= 0xFF
        cut.write_bytes(bytes(data))
        errors = pools(4).run(_verify, str(tmp_path / "ckpt" / "step_00000003"))
        assert len(set(errors)) == 1 and "rank-00002.safetensors does not match the SHA-256" in errors[0], errors
        assert "found by rank 2" in errors[0] and "no older checkpoint in this folder verifies" in errors[0]
