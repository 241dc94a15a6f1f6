"""A training step that does not log reads nothing back from the device (Engine.step), under every
strategy: counted by paratrain.train.host_sync.HostReads (on CUDA, sync debug mode checks the same:
tests/gpu/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY


def _reads(dp: int, tp: int, pp: int, zero: int, sequence_parallel: bool) -> tuple[int, list[str], int]:
    import paratrain
    from paratrain.train.host_sync import HostReads

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(
        dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sequence_parallel, bucket_mb=0.05))
    model = paratrain.build_gpt(TINY, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=2, grad_clip=1.0))
    x = torch.randint(0, 256, (8 // dp, TINY.seq_len + 1), generator=torch.Generator().manual_seed(ctx.rank))
    batch = (x[:, :-1], x[:, 1:])
    engine.step(batch, paratrain.lm_loss).stats()  # the first step sets up buffers and state
    with HostReads() as quiet:
        pending = [engine.step(batch, paratrain.lm_loss) for _ in range(2)]
    with HostReads() as logging:
        pending[-1].stats()
    return quiet.count, quiet.where, logging.count


@pytest.mark.parametrize("dp,tp,pp,zero,sp", [(2, 1, 1, 0, False), (2, 1, 1, 2, False), (2, 1, 1, 3, False),
                                              (1, 2, 1, 0, True), (1, 1, 2, 0, False)])
def test_a_step_that_does_not_log_reads_nothing(pools, dp, tp, pp, zero, sp):
    for quiet, where, logging in pools(dp * tp * pp).run(_reads, dp, tp, pp, zero, sp):
        assert quiet == 0, where
        assert logging == 1  # the loss, token count, grad norm and non-finite record: one read
