"""The collective-order check: ranks that issued different collectives on a group are stopped at the
first differing position, named; ranks that issued the same ones pass, under every strategy."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY


def _diverge() -> str:
    import paratrain
    from paratrain.comm import all_reduce
    from paratrain.comm.order import CollectiveOrderError, check_collective_order

    ctx = paratrain.init(paratrain.ParallelConfig(dp=2), device="cpu")
    group = ctx.mesh.group("dp")
    all_reduce(torch.ones(4), group)
    # the same bytes in another shape: gloo completes it, and the result is silently wrong
    all_reduce(torch.ones(2, 3) if ctx.rank == 0 else torch.ones(3, 2), group)
    try:
        check_collective_order(ctx.mesh, ctx.device)
    except CollectiveOrderError as error:
        return str(error)
    return "no error"


def test_a_diverging_rank_is_named_at_the_first_difference(pools):
    for message in pools(2).run(_diverge):
        assert "the ranks of the dp group (ranks [0, 1]) issued different collectives at #2" in message
        assert "rank 0: all_reduce [2, 3] float32; rank 1: all_reduce [3, 2] float32" in message


def _one_step(dp: int, tp: int, pp: int, zero: int) -> int:
    import paratrain
    from paratrain.comm.order import check_collective_order

    ctx = paratrain.init(paratrain.ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=tp > 1),
                         device="cpu")
    engine = paratrain.parallelize(paratrain.build_gpt(TINY, seed=0), ctx,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=2, grad_clip=1.0))
    x = torch.randint(0, 256, (8 // dp, TINY.seq_len + 1), generator=torch.Generator().manual_seed(ctx.rank))
    engine.train_step((x[:, :-1], x[:, 1:]), paratrain.lm_loss)
    return check_collective_order(ctx.mesh, ctx.device)


@pytest.mark.parametrize("dp,tp,pp,zero", [(2, 1, 1, 3), (1, 2, 1, 0), (2, 1, 2, 1)])
def test_every_strategy_passes_the_check(pools, dp, tp, pp, zero):
    compared = pools(dp * tp * pp).run(_one_step, dp, tp, pp, zero)
    assert all(count > 0 for count in compared)
