"""Our ZeRO against torch's own sharding as peers: FSDP2 (fully_shard) and ZeroRedundancyOptimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain
from tests.helpers import LR, TINY, rel_diff
from tests.margins import within

STEPS = 6
ROWS = 4  # per rank


def _batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (ROWS, TINY.seq_len + 1), generator=generator) for _ in range(STEPS)]


def _ours(zero: int) -> list[float]:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dist.get_world_size(), zero=zero))
    model = paratrain.build_gpt(TINY, seed=4, dtype=torch.float64)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    return [engine.train_step((b[:, :-1], b[:, 1:]), paratrain.lm_loss) for b in _batches(dist.get_rank())]


def _global_mean(local_mean: torch.Tensor) -> float:
    # every rank holds the same number of tokens: the global mean is the mean of the local means
    value = local_mean.detach().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _peer_losses(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """A peer's plain training loop with the mean loss (every rank holds the same token count)."""
    losses = []
    for b in _batches(dist.get_rank()):
        loss = F.cross_entropy(model(b[:, :-1]).reshape(-1, 256), b[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(loss))
    return losses


def _fsdp2() -> list[float]:
    from torch.distributed.fsdp import fully_shard

    model = paratrain.build_gpt(TINY, seed=4, dtype=torch.float64)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return _peer_losses(model, torch.optim.AdamW(model.parameters(), lr=LR))


def _zero_redundancy() -> list[float]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(paratrain.build_gpt(TINY, seed=4, dtype=torch.float64))
    return _peer_losses(model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR))


def _race(peer: str, zero: int) -> dict:
    return {"ours": _ours(zero), "peer": {"fsdp2": _fsdp2, "zero_redundancy": _zero_redundancy}[peer]()}


def test_zero3_matches_fsdp2(pools):
    result = pools(2).run(_race, "fsdp2", 3)[0]
    within(rel_diff(result["ours"], result["peer"]), 1e-12, "loss (float64)")


def test_zero1_matches_zero_redundancy_optimizer(pools):
    result = pools(2).run(_race, "zero_redundancy", 1)[0]
    within(rel_diff(result["ours"], result["peer"]), 1e-12, "loss (float64)")
