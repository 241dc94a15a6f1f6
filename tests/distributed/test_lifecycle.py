"""An engine's end: what it registered goes with it, closed or dropped (paratrain.comm.hooks, Engine.close,
Context.close), so a process that builds engine after engine (a notebook, this suite's pools) does not pile up
process groups and their gloo threads; and a model whose engine is gone refuses a backward rather than train
unreduced."""

from __future__ import annotations

import pytest


def _threads_left(close: bool) -> tuple[int, list[str]]:
    """Threads of this rank after three engines (ZeRO-3 over dp; ZeRO-2 under sequence parallelism; plain dp), each
    with its own mesh, less those before them; and what a closed engine said when asked for another step."""
    import gc
    import os

    import torch

    import paratrain
    from tests.helpers import TINY

    def threads() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/task"))

    before = threads()
    refusals = []
    for layout in (dict(dp=2, zero=3), dict(dp=1, tp=2, sequence_parallel=True, zero=2), dict(dp=2)):
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(**layout))
        engine = paratrain.parallelize(paratrain.build_gpt(TINY, seed=1), ctx,
                                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        x = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=torch.Generator().manual_seed(0))
        engine.train_step((x, x.roll(-1, 1)), paratrain.lm_loss)
        if close:
            with engine, ctx:
                pass
            try:
                engine.train_step((x, x.roll(-1, 1)), paratrain.lm_loss)
            except RuntimeError as error:
                refusals.append(str(error))
        else:
            ctx.mesh.close()  # the groups leave torch's tables; their objects go with the last reference
        del engine, ctx
    return threads() - before, refusals


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_an_engine_closed_or_dropped_frees_its_groups_threads(pools, close):
    # measured: 0 on every rank either way; before the hooks held their strategy weakly a dropped engine kept
    # 9 threads a layout here (3 groups of 3), 27 in all
    for left, refusals in pools(2).run(_threads_left, close):
        assert left == 0
        assert len(refusals) == (3 if close else 0) and all("this engine was closed" in r for r in refusals)


def _backward_without_engine() -> str:
    import gc

    import torch

    import paratrain
    from tests.helpers import TINY

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=2))
    engine = paratrain.parallelize(paratrain.build_gpt(TINY, seed=1), ctx, optimizer=lambda p: torch.optim.SGD(p, 0.1))
    model = engine.model
    del engine
    gc.collect()
    x = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    loss, count = paratrain.lm_loss(model, (x, x))
    try:
        loss.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_model_whose_engine_is_gone_refuses_backward(pools):
    for message in pools(2).run(_backward_without_engine):
        assert "GradSync (the engine's gradient strategy) was freed" in message, message
