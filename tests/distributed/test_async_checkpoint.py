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


def _copies(addresses: list[str], key: str, copies: int):
    """This rank's MemoryCopies, rank r standing for node r (its keeper addresses[r])."""
    import os

    import torch.distributed as dist

    from paratrain.checkpoint.memory_copies import ADDRESS, KEY, NODE, MemoryCopies

    rank = dist.get_rank()
    before = {name: os.environ.get(name) for name in (ADDRESS, KEY, NODE)}
    os.environ.update({ADDRESS: addresses[rank], KEY: key, NODE: str(rank)})
    try:
        return MemoryCopies(copies)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _save_with_copies_job(root: str, addresses: list[str], key: str) -> dict:
    import paratrain
    from paratrain.checkpoint.async_save import AsyncSaver

    engine, batch = _engine(1)
    copies = _copies(addresses, key, 1)
    saver = AsyncSaver()
    for step in (1, 2, 3):  # the keepers hold the newest 2 of each rank
        engine.train_step(batch, paratrain.lm_loss)
        saver.save(root, step, engine.view(), {"loader": {"epoch": 0, "cursor": step}}, copies=copies)
    saver.close()
    engine.close()
    return {"targets": copies.targets, "missed": saver.missed}


def _load_from_copies_job(root: str, addresses: list[str], key: str) -> dict:
    import torch

    from paratrain.checkpoint import CheckpointError, load_sharded, verify_shared

    disk, _ = _engine(1)
    folder = Path(root) / "step_00000003"
    load_sharded(folder, verify_shared(folder), disk.view())
    engine, _ = _engine(1)
    copies = _copies(addresses, key, 1)
    found = copies.newest(at_least=3)
    assert copies.newest(at_least=4) is None
    meta = copies.load(*found, engine.view())
    same = all(torch.equal(a, b) for a, b in zip(engine.view().local_state().tensors.values(),
                                                  disk.view().local_state().tensors.values()))
    error = None
    try:
        copies.load(found[0] - 2, found[1], engine.view())  # step 1: no longer held
    except CheckpointError as failed:
        error = str(failed)
    disk.close()
    engine.close()
    return {"step": found[0], "holders": found[1], "cursor": meta["loader"]["cursor"], "same": same,
            "old_step": error}


def test_memory_copies_restore_the_disk_checkpoints_state_from_a_peers_ram(pools, tmp_path):
    """dp 2 ZeRO-1, each rank standing for a node with its own keeper, one memory copy (rank r's file to keepers r
    and 1 - r), three saves. Keeper 1 then lost (its node): the newest complete step is 3, held whole by keeper 0,
    and loading from it sets the state the disk checkpoint of step 3 sets, tensor for tensor; step 1 was dropped
    (the newest 2 kept)."""
    from paratrain.checkpoint.memory_copies import Keeper

    key = bytes(range(32))
    keepers = [Keeper("127.0.0.1", key), Keeper("127.0.0.1", key)]
    addresses = [k.address for k in keepers]
    try:
        saved = pools(2).run(_save_with_copies_job, str(tmp_path), addresses, key.hex())
        assert [r["targets"] for r in saved] == [addresses, addresses[::-1]] and not any(r["missed"] for r in saved)
        keepers[1].close()
        got = pools(2).run(_load_from_copies_job, str(tmp_path), addresses, key.hex())
    finally:
        keepers[0].close()
        keepers[1].close()
    for r in got:
        assert r["step"] == 3 and set(r["holders"].values()) == {addresses[0]} and r["cursor"] == 3, r
        assert r["same"] and "holds no copy of rank 0's step 1" in r["old_step"], r
