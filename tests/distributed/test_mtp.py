"""Multi-token prediction (paratrain.models.gpt_mtp) against oracles that do not share its code: the loss written by
hand on truncated sequences (DeepSeek-V3's formulation), packed documents against the documents run apart, and every
layout (tp + sequence parallelism, pp, cp ring and Ulysses, ZeRO-3, recompute) against plain PyTorch in one process,
on packed documents (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.nn.sequence import look_ahead
from tests.distributed.test_documents import SEQ, STEPS, VOCAB, batch
from tests.helpers import lr_at, max_state_diff, rel_diff
from tests.margins import within

DEPTH = 2


def build(depth: int = DEPTH, **overrides) -> torch.nn.Module:
    import paratrain
    from paratrain.config import preset

    config = preset("tiny", seq_len=SEQ, vocab_size=VOCAB, mtp_depth=depth, mtp_weight=0.5, **overrides)
    return paratrain.build_gpt(config, seed=3, dtype=torch.float64)


def hand_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's equations on one window without documents: depth k runs on the first S - k positions only
    (causal attention: their outputs are those of the whole), fed the embeddings of inputs[k:] and scored on
    targets[k:]; the mean is over the next-token loss's count."""
    def ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="sum")

    x = model.tok_emb(inputs)
    for block in model.blocks:
        x = block(x, model.rope_cos, model.rope_sin)
    total, seq = ce(model.head(model.norm(x)), targets), inputs.shape[1]
    for k, depth in enumerate(model.mtp.depths, start=1):
        x = depth(x[:, :seq - k], model.tok_emb(inputs[:, k:]), model.rope_cos, model.rope_sin, None)
        total = total + model.config.mtp_weight / DEPTH * ce(model.head(depth.norm(x)), targets[:, k:])
    return total / targets.numel()


def test_the_loss_is_deepseeks_written_by_hand():
    """float64, one process: lm_loss with MTP depths 2 (weight 0.5) equals the hand-written loss (measured 0 with avx2
    kernels, 2.9e-16 with the default ones; gradient 4.9e-17), and its gradient too; in eval the loss is the
    next-token model's alone."""
    from paratrain.models import lm_loss

    model = build()
    inputs = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(inputs, -1, dims=1)
    total, count = lm_loss(model, (inputs, targets))
    mine = total / count
    grads = torch.autograd.grad(mine, list(model.parameters()))
    theirs = hand_loss(model, inputs, targets)
    expected = torch.autograd.grad(theirs, list(model.parameters()))
    within(abs(float(mine - theirs)) / float(theirs), 1e-14, "MTP loss against the hand-written one (float64)")
    within(max(float((a - b).abs().max()) for a, b in zip(grads, expected)), 1e-14, "its gradient (float64)")
    model.eval()
    main, _ = lm_loss(model, (inputs, targets))
    plain = F.cross_entropy(model(inputs)[..., :VOCAB].flatten(0, 1), targets.flatten(), reduction="sum")
    assert float(main) == pytest.approx(float(plain), rel=1e-14) and float(main) < float(total)


def test_packed_documents_take_the_loss_of_their_documents_apart():
    """Each piece of a packed window (positions restarting at its documents) run alone through lm_loss: the sums
    of the pieces are the window's, so no depth reads or predicts a token of another document (measured 2.2e-16)."""
    from paratrain.models import lm_loss

    model = build()
    inputs, targets, positions = batch(0)
    packed, count = lm_loss(model, (inputs, targets, positions))
    apart = torch.zeros((), dtype=torch.float64)
    for ids, labels, pos in zip(inputs, targets, positions):
        cuts = [*torch.nonzero(pos == 0).flatten().tolist(), len(ids)]
        for a, b in zip(cuts, cuts[1:]):
            apart = apart + lm_loss(model, (ids[None, a:b], labels[None, a:b]))[0]
    assert int(count) == int((targets != -100).sum())
    within(abs(float(packed - apart)) / float(apart), 1e-14, "packed MTP loss against the documents apart (float64)")


def test_look_ahead_fills_past_the_end_and_across_documents():
    values = torch.tensor([[10, 11, 12, 13, 14, 15]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # documents [0, 3), [3, 6)
    assert look_ahead(values, 1, -1).tolist() == [[11, 12, 13, 14, 15, -1]]
    assert look_ahead(values, 2, -1, documents=positions).tolist() == [[12, -1, -1, 15, -1, -1]]
    assert look_ahead(values, 6, -1).tolist() == [[-1] * 6]


_PLAIN: list[dict] = []


def plain() -> dict:
    """The oracle: plain PyTorch in one process on the whole global batch (sum of losses backpropagated, gradients
    divided by the count, AdamW), the GPT's lm_loss giving the sum."""
    if not _PLAIN:
        from paratrain.models import lm_loss

        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.1)
        losses, norms = [], []
        for step in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            total, count = lm_loss(model, batch(step))
            optimizer.zero_grad()
            total.backward()
            for p in model.parameters():
                p.grad /= count
            norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
            optimizer.step()
            losses.append(float(total / count))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()
                 if k not in ("head.weight", "mtp.tok_emb.weight")}  # tied: kept once, as tok_emb.weight
        _PLAIN.append({"losses": losses, "grad_norms": norms, "model": state})
    return _PLAIN[0]


def _job(**layout) -> dict:
    import paratrain

    micro_batch, recompute = layout.pop("micro_batch", None), layout.pop("recompute", False)
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(**layout))
    engine = paratrain.parallelize(build(), ctx, optimizer=lambda p: torch.optim.AdamW(p, lr=lr_at(0), weight_decay=0.1),
                                   options=paratrain.EngineOptions(micro_batch=micro_batch, recompute=recompute))
    losses, norms = [], []
    for step in range(STEPS):
        engine.set_lr(lr_at(step))
        losses.append(engine.train_step(batch(step, ctx.mesh.degree("dp"), ctx.mesh.index("dp")),
                                        paratrain.models.lm_loss))
        norms.append(engine.last.grad_norm)
    return {"losses": losses, "grad_norms": norms, "model": engine.state_dict()["model"]}


@pytest.mark.parametrize("layout", [
    dict(tp=2, sequence_parallel=True, micro_batch=4),  # the depths' embedding split over the vocabulary, SP chunks
    dict(pp=2, schedule="zb-h1", micro_batch=2),  # the depths on the last stage, a tied copy of the embedding; ZB's W
    dict(cp=2, tp=2, cp_mode="ulysses", micro_batch=4),  # tokens and labels ahead gathered over cp, shifted, kept
    dict(pp=2, cp=2, micro_batch=2),  # ... under ring attention, on the last stage
    dict(dp=2, zero=3, recompute=True, micro_batch=2),  # the depths' blocks are ZeRO-3 units, recomputed
], ids=["tp2-sp", "pp2-zbh1", "cp2-ulysses-tp2", "pp2xcp2-ring", "dp2-zero3-recompute"])
def test_every_layout_trains_as_one_process(pools, layout):
    """MTP depth 2 (weight 0.5) on packed documents, 3 AdamW steps, float64: loss, gradient norm and weights within
    1e-12 of plain PyTorch in one process (tiny-dsmoe's one depth runs the MoE tests' layouts too). Measured (AMD EPYC,
    avx2 and default kernels): loss <= 3.1e-16, gradient norm <= 2.0e-15, weights <= 2.8e-15 (pp 2 x cp 2, default)."""
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    got = pools(world).run(_job, **layout)
    ref = plain()
    for rank in got:
        within(rel_diff(rank["losses"], ref["losses"]), 1e-12, "MTP loss (float64)")
        within(rel_diff(rank["grad_norms"], ref["grad_norms"]), 1e-12, "MTP grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "MTP weights (float64)")
