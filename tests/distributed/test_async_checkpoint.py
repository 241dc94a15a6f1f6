"""Asynchronous checkpoints (paratrain.checkpoint.async_save) against synchronous ones: the same bytes, whatever the
weights do after the copy; a writer killed mid-write publishes nothing and the next save still lands."""

from __future__ import annotations

from pathlib import Path


def _engine(zero: int):
    import torch

    import paratrain
    from paratrain.config import preset

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=2, zero=zero))
    model = paratrain.build_gpt(preset("tiny"), seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    generator = torch.Generator().manual_seed(ctx.rank)
    batch = torch.randint(0, 256, (4, 65), generator=generator)
    return engine, (batch[:, :-1], batch[:, 1:])


def _same_bytes_job(root: str, zero: int) -> dict:
    import torch

    import paratrain
    from paratrain.checkpoint.async_save import AsyncSaver
    from paratrain.checkpoint.sharded import save_sharded

    engine, batch = _engine(zero)
    for _ in range(2):
        engine.train_step(batch, paratrain.lm_loss)
    meta = {"loader": {"epoch": 0, "cursor": 8}}
    save_sharded(Path(root) / "sync", 2, engine.view(), meta)
    saver = AsyncSaver(delay_s=0.5)  # the writer starts after the weights below have changed
    saver.save(Path(root) / "async", 2, engine.view(), meta)
    with torch.no_grad():  # right after the copy: the weights, and by a step the optimizer state
        for p in engine.model.parameters():
            p.add_(1.0)
    engine.train_step(batch, paratrain.lm_loss)
    saver.close()
    engine.close()
    return {"blocked_s": saver.blocked_s}


def test_async_save_writes_the_sync_bytes_whatever_follows_the_copy(pools, tmp_path):
    """dp 2 ZeRO-1 (each rank its shard): every file of the asynchronous checkpoint, meta.json included, is the
    synchronous one's byte for byte, though the weights and the optimizer state changed right after the copy."""
    from paratrain.checkpoint import verify_shared

    pools(2).run(_same_bytes_job, str(tmp_path), 1)
    sync, done = tmp_path / "sync" / "step_00000002", tmp_path / "async" / "step_00000002"
    assert (tmp_path / "async" / "latest").read_text().strip() == "step_00000002"
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in done.iterdir()) and "rank-00001.safetensors" in names
    for name in names:
        assert (sync / name).read_bytes() == (done / name).read_bytes(), name
    verify_shared(done)


def _killed_job(root: str, victim: int) -> dict:
    import os
    import signal
    import time

    import paratrain
    from paratrain.checkpoint import CheckpointError
    from paratrain.checkpoint.async_save import AsyncSaver

    engine, batch = _engine(2)
    saver = AsyncSaver()
    engine.train_step(batch, paratrain.lm_loss)
    saver.save(root, 1, engine.view(), {})
    engine.train_step(batch, paratrain.lm_loss)
    saver.delay_s = 30.0 if engine.ctx.rank == victim else 0.0  # the victim's writer sleeps before writing
    saver.save(root, 2, engine.view(), {})
    if engine.ctx.rank == victim:
        time.sleep(1.0)
        os.kill(saver.writer_pid, signal.SIGKILL)
    error = None
    try:
        saver.wait()
    except CheckpointError as failed:
        error = str(failed)
    latest_after_kill = (Path(root) / "latest").read_text().strip()
    saver.delay_s = 0.0
    engine.train_step(batch, paratrain.lm_loss)
    saver.save(root, 3, engine.view(), {})  # a fresh writer where the old one died; the other's still serves
    saver.close()
    engine.close()
    return {"error": error, "latest_after_kill": latest_after_kill}


def test_a_writer_killed_mid_write_publishes_nothing(pools, tmp_path):
    """dp 2 ZeRO-2: rank 1's writer SIGKILLed before step 2's file is written. Both ranks are told (rank 0's writer
    stops waiting for rank 1's share), `latest` still names step 1, which verifies; step 3 saves and publishes."""
    from paratrain.checkpoint import verify_shared

    got = pools(2).run(_killed_job, str(tmp_path), 1)
    assert "rank 1's checkpoint writer died" in got[1]["error"], got
    assert "rank 1's checkpoint writer did not write step 2 (its writer died" in got[0]["error"], got
    assert all(r["latest_after_kill"] == "step_00000001" for r in got)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert not (tmp_path / "step_00000002").exists()
    verify_shared(tmp_path / "step_00000001")
    verify_shared(tmp_path / "step_00000003")
