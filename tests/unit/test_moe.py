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
from paratrain.nn.moe import MoE
from paratrain.nn.router import Router, RouterSettings, within_capacity


def layer(*, top_k: int = 2, capacity_factor: float = 0.0, shared: bool = False, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=8, d_ff=12)
    moe = MoE(8, n_experts=4, d_ff=12, router=RouterSettings(top_k=top_k, capacity_factor=capacity_factor,
                                                             aux_coef=0.01, z_coef=0.001),
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
    with pytest.raises(ConfigError, match="top_k must be in 1 .. 4"):
        preset("tiny-moe", top_k=5)
    with pytest.raises(ConfigError, match="top_k must be in 1 .. 8"):
        preset("tiny-dsmoe", top_k=9)
    with pytest.raises(ConfigError, match="router must be 'softmax' or 'sigmoid'"):
        preset("tiny-moe", router="relu")
    with pytest.raises(ConfigError, match="expert_groups .3. must divide n_experts .16."):
        preset("tiny-dsmoe", expert_groups=3)
    with pytest.raises(ConfigError, match="topk_groups .5. must be in 1 .. expert_groups .4."):
        preset("tiny-dsmoe", topk_groups=5)
    with pytest.raises(ConfigError, match="the groups kept hold 4 experts"):
        preset("tiny-dsmoe", topk_groups=1, top_k=6)
    with pytest.raises(ConfigError, match="expert_bias_rate must be a finite number >= 0"):
        preset("tiny-dsmoe", expert_bias_rate=-1.0)
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


def test_the_sigmoid_group_limited_router_is_deepseek_v3s():
    """RouterSettings(sigmoid, 16 experts in 4 groups of which 2 kept, top-4, x 2.5, a bias) chooses the experts and
    weights transformers' DeepseekV3TopkRouter does with the same weight and e_score_correction_bias (float64 in,
    float32 routing as both do): 4,096 tokens, ids equal as sets, weights within 1e-6."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(config)
    mine = Router(32, 16, RouterSettings(top_k=4, scores="sigmoid", groups=4, topk_groups=2, scale=2.5,
                                         bias_rate=0.001))
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_(std=0.3)
        theirs.e_score_correction_bias.normal_(std=0.05)
        mine.weight.copy_(theirs.weight)
        mine.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(8, 512, 32)
    _, weights, ids = theirs(x)
    routing = mine(x)
    ours = routing.expert.reshape(-1, 4)
    order, their_order = ours.sort(dim=-1), ids.sort(dim=-1)
    assert torch.equal(order.values, their_order.values)
    gate = routing.gate.reshape(-1, 4).gather(-1, order.indices)
    assert torch.allclose(gate, weights.gather(-1, their_order.indices), atol=1e-6, rtol=0)
    groups = ours // 4  # the chosen experts come from at most 2 groups
    assert max(len(set(row)) for row in groups.tolist()) <= 2


def test_top_8_softmax_and_the_bias_rule():
    """Softmax top-8 of 32 experts: the 8 largest probabilities, renormalised; the balancing bias moves by the rate
    towards the mean count (up under it, down over it, still at it) and moves the choice, never the weights."""
    router = Router(16, 32, RouterSettings(top_k=8))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(2, 64, 16)
    routing = router(x)
    probs = torch.softmax(torch.nn.functional.linear(x, router.weight), dim=-1)
    top = probs.topk(8, dim=-1)
    assert torch.equal(routing.expert, top.indices)
    assert torch.allclose(routing.gate, top.values / top.values.sum(-1, keepdim=True))
    biased = Router(16, 4, RouterSettings(top_k=1, scores="sigmoid", bias_rate=0.25))
    biased.update_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]))  # mean 4
    assert biased.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.25]
    torch.nn.init.zeros_(biased.weight)  # every score 0.5: the bias alone decides, the weight stays 1
    routing = biased(torch.randn(1, 3, 16))
    assert set(routing.expert.reshape(-1).tolist()) <= {1, 3} and torch.allclose(routing.gate, torch.ones(1, 3, 1))
