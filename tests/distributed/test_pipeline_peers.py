"""Pipeline parallelism of any nn.Sequential, against the single process and torch.distributed.pipelining."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paratrain
from tests.helpers import rel_diff
from tests.margins import within

ROWS, WIDTH, STEPS = 16, 12, 5


def _model() -> nn.Sequential:
    torch.manual_seed(11)  # the same weights on every rank
    return nn.Sequential(nn.Linear(WIDTH, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, WIDTH)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64))


def _squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return ((output - target) ** 2).sum(), target.numel()


def paratrain_run(pp: int | None, schedule: str = "1f1b") -> list[float]:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=1, pp=pp or 1, schedule=schedule, pp_split=(4,) if pp else ()))
    model = _model()
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
                                   options=paratrain.EngineOptions(micro_batch=4),
                                   recipe=paratrain.recipe_for(model, pipeline_loss=_squared_error))
    x, y = _data()
    return [engine.train_step((x, y), lambda m, b: _squared_error(m(b[0]), b[1])) for _ in range(STEPS)]


def torch_pipelining_run(schedule: str) -> list[float]:
    """The same split (layers 0-3 | 4-6), torch's PipelineStage and schedule, the same SGD."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    model = _model()
    part = nn.Sequential(*list(model.children())[:4]) if rank == 0 else nn.Sequential(*list(model.children())[4:])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    x, y = _data()
    total = y.numel()

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).sum() / total  # the engine's sum over the global batch / its count

    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    pipe = kind(stage, n_microbatches=ROWS // 4, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.05)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        collected: list[torch.Tensor] = []
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=collected)
        optimizer.step()
        value = torch.tensor([float(sum(collected)) if rank == 1 else 0.0], dtype=torch.float64)
        dist.all_reduce(value)
        losses.append(float(value))
    return losses


def _both(schedule: str) -> dict:
    return {"paratrain": paratrain_run(2, schedule), "torch": torch_pipelining_run(schedule)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequential_pipeline_matches_single_process_and_torch_pipelining(pools, schedule):
    ref = paratrain_run(None)
    got = pools(2).run(_both, schedule)[0]
    within(rel_diff(got["paratrain"], ref), 1e-12, "loss (float64)")
    within(rel_diff(got["torch"], ref), 1e-12, "loss (float64)")  # the peer, on the same split, agrees
