"""A step whose loss is nan on one rank's sample: every rank stops alike and names that rank, or
(on_non_finite="skip") every rank skips that update and training goes on as on one process."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tests.helpers import TINY, lr_at, rel_diff
from tests.margins import within

POISON_STEP, POISON_ROW = 2, 12  # row 12 of the global batch of 16: dp rank 1's at dp 2


def _nan_loss(row: torch.Tensor, model: torch.nn.Module, micro: tuple[torch.Tensor, torch.Tensor]):
    inputs, targets = micro
    per_token = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
    weight = torch.where((inputs == row).all(dim=1), float("nan"), 1.0)
    return (per_token.view_as(targets).sum(dim=1) * weight).sum(), targets.numel()


def _run(dp: int | None, policy: str, steps: int = 6) -> dict:
    import paratrain
    from paratrain.data import GlobalBatchLoader, load_source
    from paratrain.hybrid import NonFiniteError

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dp, bucket_mb=0.05))
    model = paratrain.build_gpt(TINY, seed=4)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=2, grad_clip=1.0, on_non_finite=policy))
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=TINY.seq_len, global_batch=16,
                               dp=ctx.mesh.degree("dp"), dp_index=ctx.mesh.index("dp"), seed=4)
    losses, skipped, ranks = [], [], []
    for step in range(steps):
        engine.set_lr(lr_at(step))
        loss_fn = paratrain.lm_loss
        if step == POISON_STEP:
            loss_fn = functools.partial(_nan_loss, loader.gather([loader.global_indices()[POISON_ROW]])[0][0])
        try:
            losses.append(engine.train_step(loader.next(), loss_fn))
        except NonFiniteError as error:
            return {"error": str(error), "ranks": error.ranks, "step": step}
        skipped.append(engine.last.skipped)
        ranks.append(engine.last.non_finite_ranks)
    return {"losses": losses, "skipped": skipped, "ranks": ranks}


def test_every_rank_stops_at_a_non_finite_step_naming_the_rank(pools):
    for got in pools(2).run(_run, 2, "raise"):
        assert got["step"] == POISON_STEP and got["ranks"] == (1,)
        assert "the loss of rank(s) [1]' own samples was not finite" in got["error"]


def test_skip_policy_matches_the_single_process(pools):
    reference = _run(None, "skip")
    expected = [step == POISON_STEP for step in range(6)]
    assert reference["skipped"] == expected and reference["ranks"][POISON_STEP] == (0,)
    for got in pools(2).run(_run, 2, "skip"):
        assert got["skipped"] == expected and got["ranks"][POISON_STEP] == (1,)
        kept = [i for i in range(6) if i != POISON_STEP]  # the poisoned step's loss is nan everywhere
        within(rel_diff([got["losses"][i] for i in kept], [reference["losses"][i] for i in kept]), 1e-5, "loss")
