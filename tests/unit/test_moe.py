"""The MoE layer on one process, against its definition written out token by token (float64): routing,
per-sequence capacity, the auxiliary losses and the gradient they inject; and what makes it
layout-free: a batch cut into pieces routes, drops and adds up exactly as the whole."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from paratrain.config import ConfigError
from paratrain.config.model import ModelConfig, preset
from paratrain.memory import apply_recompute
from paratrain.models import build_gpt, lm_loss
from paratrain.models.gpt import MLP
from paratrain.nn.moe import MoE, within_capacity


def layer(*, top_k: int = 2, capacity_factor: float = 0.0, shared: bool = False, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=8, d_ff=12)
    moe = MoE(8, n_experts=4, top_k=top_k, d_ff=12, capacity_factor=capacity_factor, aux_coef=0.01, z_coef=0.001,
              shared=MLP(config) if shared else None)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return moe.double()


@torch.no_grad()
def by_hand(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, float, float, int]:
    """The definition, one sequence and one token at a time: output, balance term, z term, drops."""
    batch, seq, d = x.shape
    k, experts = moe.router.top_k, moe.experts.up.shape[0]
    limit = math.ceil(moe.router.capacity_factor * seq * k / experts) if moe.router.capacity_factor else seq * k
    out = torch.zeros_like(x)
    balance = z = 0.0
    dropped = 0
    for b in range(batch):
        logits = x[b] @ moe.router.weight.T
        probs = torch.softmax(logits, -1)
        top = [torch.topk(probs[s], k) for s in range(seq)]
        taken = [0] * experts
        kept = {}
        for j in range(k):  # first choices of every position, then second choices
            for s in range(seq):
                e = int(top[s].indices[j])
                kept[(s, j)] = taken[e] < limit
                dropped += not kept[(s, j)]
                taken[e] += 1
        for s in range(seq):
            gates = top[s].values / (top[s].values.sum() if k > 1 else 1.0)
            for j in range(k):
                e = int(top[s].indices[j])
                if kept[(s, j)]:
                    hidden = F.gelu(moe.experts.up[e] @ x[b, s], approximate="tanh")
                    out[b, s] += gates[j] * (moe.experts.down[e] @ hidden)
        fraction = torch.zeros(experts, dtype=x.dtype)
        for s in range(seq):
            for e in top[s].indices:
                fraction[e] += 1.0 / (seq * k)
        balance += 0.01 * seq * experts * float((fraction * probs.mean(0)).sum())
        z += 0.001 * float(torch.logsumexp(logits, -1).pow(2).sum())
    if moe.shared is not None:
        out = out + moe.shared(x)
    return out, balance, z, dropped


@pytest.mark.parametrize("top_k,capacity_factor,shared", [(1, 0.0, False), (2, 0.0, True), (2, 1.0, False),
                                                          (1, 1.25, False)])
def test_layer_equals_its_definition(top_k, capacity_factor, shared):
    moe = layer(top_k=top_k, capacity_factor=capacity_factor, shared=shared)
    x = torch.randn(3, 10, 8, dtype=torch.float64)
    want, balance, z, dropped = by_hand(moe, x)
    got = moe(x)
    assert torch.allclose(got, want, rtol=0, atol=1e-13)
    assert float(moe.log.balance_sum) == pytest.approx(balance, rel=1e-13)
    assert float(moe.log.z_sum) == pytest.approx(z, rel=1e-13)
    assert float(moe.log.aux_sum) == pytest.approx(balance + z, rel=1e-13)
    assert moe.log.assigned == 3 * 10 * top_k
    assert float(moe.log.dropped) == dropped and (capacity_factor > 0 or dropped == 0)


def test_capacity_takes_first_choices_first_in_sequence_order():
    # one sequence of 3 tokens, top-2 over 2 experts, capacity 2 per expert
    expert = torch.tensor([[[0, 1], [0, 1], [0, 1]]])
    keep = within_capacity(expert, 2, 2)
    # expert 0 queue: (s0,j0) (s1,j0) (s2,j0): the third is dropped; expert 1: (s0,j1) (s1,j1) (s2,j1)
    assert keep.tolist() == [[[True, True], [True, True], [False, False]]]
    assert within_capacity(expert, 2, 0).all()  # dropless


def test_injected_gradient_is_the_gradient_of_the_whole_loss():
    """d(CE sum + auxiliary terms)/dW by central differences equals what backward of the CE sum alone gives."""
    model = build_gpt(preset("tiny-moe", seq_len=16, capacity_factor=1.0), seed=1, dtype=torch.float64)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])

    def total() -> float:
        model.router_log.reset()
        loss_sum, _ = lm_loss(model, batch)
        return float(loss_sum) + float(model.router_log.aux_sum)

    model.router_log.reset()
    loss_sum, _ = lm_loss(model, batch)
    loss_sum.backward()
    for name in ("blocks.1.moe.router.weight", "blocks.3.moe.experts.up", "blocks.0.attn.qkv.weight"):
        param = model.get_parameter(name)
        direction = torch.randn(param.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        h = 1e-6
        with torch.no_grad():
            param += h * direction
            up = total()
            param -= 2 * h * direction
            down = total()
            param += h * direction
        numeric = (up - down) / (2 * h)
        assert float((param.grad * direction).sum()) == pytest.approx(numeric, rel=1e-6), name


def test_pieces_of_a_batch_route_and_add_up_as_the_whole():
    """What dp, accumulation and ep rely on: capacity and the auxiliary losses are per sequence."""
    moe = layer(top_k=2, capacity_factor=1.0)
    x = torch.randn(4, 10, 8, dtype=torch.float64)
    whole = moe(x)
    sums = (float(moe.log.aux_sum), float(moe.log.dropped), moe.log.expert_tokens[""].clone())
    moe.log.reset()
    parts = torch.cat([moe(x[:1]), moe(x[1:3]), moe(x[3:])])
    assert torch.allclose(parts, whole, rtol=0, atol=1e-14)
    assert float(moe.log.aux_sum) == pytest.approx(sums[0], rel=1e-14)
    assert float(moe.log.dropped) == sums[1]
    assert torch.equal(moe.log.expert_tokens[""], sums[2])


def test_recomputation_and_evaluation_log_nothing_more():
    model = build_gpt(preset("tiny-moe", seq_len=16), seed=0, dtype=torch.float64)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    model.router_log.reset()
    loss_sum, _ = lm_loss(model, batch)
    loss_sum.backward()
    plain = (float(model.router_log.aux_sum), [p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    apply_recompute(model)
    model.router_log.reset()
    loss_sum, _ = lm_loss(model, batch)
    loss_sum.backward()  # the blocks run forward again here
    assert float(model.router_log.aux_sum) == plain[0]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain[1]))
    model.eval()
    model.router_log.reset()
    with torch.no_grad():
        lm_loss(model, batch)
    assert model.router_log.aux_sum is None


def test_moe_settings_are_checked():
    with pytest.raises(ConfigError, match="top_k must be 1 or 2"):
        preset("tiny-moe", top_k=3)
    with pytest.raises(ConfigError, match="n_experts must be 0"):
        preset("tiny", n_experts=1)
    with pytest.raises(ConfigError, match="moe_every must be in"):
        preset("tiny-moe", moe_every=9)
    with pytest.raises(ConfigError, match="capacity_factor must be"):
        preset("tiny-moe", capacity_factor=-1.0)
    config = preset("tiny-moe")
    assert [config.is_moe(i) for i in range(4)] == [False, True, False, True]
    model = build_gpt(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    # a token runs through 2 of 4 experts: half the expert parameters are active
    experts = 2 * (4 * 2 * 64 * 128)
    assert config.num_params() - config.active_params() == experts // 2
