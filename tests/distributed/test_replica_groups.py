"""Replica groups (fault_tolerance 'replica') in float64 against one process: two groups of dp 2 x ZeRO-2, each its own
world (as their launchers start them), meeting through a lighthouse store this test holds; rank 3 SIGKILLs itself at
step 4 (in its backward), and group 0 redoes that step alone. The whole TrainLoop runs (paratrain.train.fault_tolerance); the one
process runs the same loop on the same global batches. (The CLI's launchers, the timing and a group rejoining:
tests/e2e/test_cli.py.)"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import paratrain
from paratrain.data import GlobalBatchLoader, load_source
from paratrain.models import lm_loss
from paratrain.topology import join, lay_out
from paratrain.topology.quorum import Quorum, connect
from paratrain.train.faults import FaultInjection
from paratrain.train.loop import TrainLoop
from paratrain.train.loop_settings import LoopSettings
from tests.helpers import LR, TINY, WARMUP
from tests.margins import within

STEPS, GLOBAL, GROUPS, RANKS = 8, 16, 2, 2
SETTINGS = LoopSettings(steps=STEPS, lr=LR, warmup_steps=WARMUP, min_lr_ratio=1.0)


def _loop(ctx: paratrain.Context, hooks: list) -> TrainLoop:
    model = paratrain.build_gpt(TINY, seed=7, dtype=torch.float64)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
                                   options=paratrain.EngineOptions(micro_batch=2, grad_clip=1.0, seed=7))
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=TINY.seq_len, global_batch=GLOBAL, dp=1,
                               dp_index=0, seed=7)
    return TrainLoop(engine, ctx, lm_loss, loader, None, SETTINGS, hooks=hooks)


def _group_rank(group: int, rank: int, port: int, lighthouse: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(RANKS), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=3)  # the quorum's: how soon a group that stops answering is dropped
    member = join("cpu", timeout=timedelta(seconds=120))  # the group's own world: its ranks start seconds apart
    config = paratrain.ParallelConfig(dp=GROUPS * RANKS, zero=2, bucket_mb=0.05, fault_tolerance="replica",
                                      replica_groups=GROUPS).resolved(GROUPS * RANKS)
    quorum = Quorum(connect(lighthouse, timedelta(seconds=60)), group=group, groups=GROUPS, rank=rank, world=RANKS,
                    timeout=timeout)
    ctx = lay_out(member, config, timeout=timedelta(seconds=120), replicas=quorum)
    loop = _loop(ctx, [FaultInjection("3:4:kill-backward", rank=group * RANKS + rank, attempt=0)])
    result = loop.run()
    Path(out).write_text(json.dumps({"losses": result.losses, "recoveries": [
        {k: v for k, v in r.items() if k != "failed_at"} for r in loop.replicas.recoveries]}))
    dist.destroy_process_group()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_lost_group_costs_a_redone_step_and_the_losses_stay_one_process_s(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    lighthouse = f"127.0.0.1:{store.port}"
    spawn = multiprocessing.get_context("spawn")
    ports = [_free_port() for _ in range(GROUPS)]
    workers = [spawn.Process(target=_group_rank, args=(g, r, ports[g], lighthouse, str(tmp_path / f"{g}-{r}.json")))
               for g in range(GROUPS) for r in range(RANKS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=180)
    codes = [w.exitcode for w in workers]
    assert codes[:2] == [0, 0] and codes[3] == -9 and codes[2] != 0, codes  # group 1 gone: rank 3 killed, rank 2 failed
    survivors = [json.loads((tmp_path / f"0-{r}.json").read_text()) for r in range(RANKS)]
    reference = _loop(paratrain.init(device="cpu", config=paratrain.ParallelConfig()), []).run().losses
    for got in survivors:
        assert got["recoveries"][0]["step"] == 4 and got["recoveries"][0]["members"] == [0]
        losses = {int(k): v for k, v in got["losses"].items()}
        assert sorted(losses) == list(range(1, STEPS + 1))
        # measured: <= 3.2e-16 relative (avx2 and default kernels)
        within(max(abs(losses[s] - reference[s]) / reference[s] for s in reference), 1e-12,
               "loss with a replica group lost at step 4 (float64)")
