"""paratrain.optim.Muon in one process against torch.optim.Muon (+ torch.optim.AdamW for the rest), its choices of
matrices, its refusals, and MatrixExchange's plan on one rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.optim import (AdamWSettings, Held, LocalMatrices, MatrixExchange, Muon, MuonSettings, is_matrix,
                             newton_schulz_flops)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        self.tok_emb = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 24)
        self.down = nn.Linear(24, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.experts = nn.Parameter(torch.randn(3, 8, 6, generator=g) * 0.3)
        for p in self.parameters():
            p.data = p.data.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.down(torch.relu(self.up(self.tok_emb(x)))))
        return (torch.einsum("bd,edf->bef", h, self.experts) ** 2).mean() + (h @ self.tok_emb.weight.T).pow(2).mean()


def _train(opt_for, steps: int = 10) -> Net:
    net = Net()
    steps_of = opt_for(net)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 16, (12,), generator=g)
        for opt in steps_of:
            opt.zero_grad()
        net(x).backward()
        for opt in steps_of:
            opt.step()
    return net


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_one_process_equals_torch_muon_and_adamw(adjust):
    """float64 weights, bfloat16 Newton-Schulz (torch's), 10 steps: bit for bit (measured 0.0)."""
    settings = MuonSettings(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)
    adamw = AdamWSettings(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def ours(net: Net) -> list[torch.optim.Optimizer]:
        return [Muon(net.named_parameters(), settings, adamw)]

    def theirs(net: Net) -> list[torch.optim.Optimizer]:
        matrices = [net.up.weight, net.down.weight]
        decayed = [net.tok_emb.weight]
        rest = [net.up.bias, net.norm.weight, net.norm.bias]
        experts = [nn.Parameter(net.experts.data[e]) for e in range(3)]  # each expert its own 2-D matrix

        class Experts(torch.optim.Optimizer):  # torch's Muon on views of each expert, grads cut alike
            def __init__(self) -> None:
                super().__init__([net.experts], {})
                self.inner = torch.optim.Muon(experts, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust)

            def step(self, closure=None):  # type: ignore[override]
                for e, p in enumerate(experts):
                    p.grad = net.experts.grad[e]
                self.inner.step()
                with torch.no_grad():
                    for e, p in enumerate(experts):
                        net.experts[e].copy_(p)

        return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust),
                torch.optim.AdamW(decayed, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1),
                torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), weight_decay=0.0), Experts()]

    a, b = _train(ours), _train(theirs)
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_which_parameters_are_matrices():
    opt = Muon(Net().named_parameters())
    kinds = {g["kind"] + str(g["weight_decay"]): len(g["params"]) for g in opt.param_groups}
    assert kinds == {"muon0.1": 3, "adamw0.1": 1, "adamw0.0": 3}  # up, down, experts | tok_emb | biases, norm
    assert not is_matrix("model.embed_tokens.weight", (10, 4)) and not is_matrix("lm_head.weight", (10, 4))
    assert is_matrix("model.layers.0.self_attn.q_proj.weight", (4, 4)) and not is_matrix("norm.weight", (4,))
    assert len(Muon(Net().parameters()).matrix_tensors()) == 4  # bare tensors: dims alone (the embedding too)


@pytest.mark.parametrize("bad, rule", [
    (dict(momentum=1.0), "momentum must be in [0, 1)"), (dict(ns_steps=0), "ns_steps must be in [1, 100)"),
    (dict(lr=-1.0), "lr must be >= 0"), (dict(adjust_lr_fn="x"), "adjust_lr_fn must be one of"),
    (dict(ns_dtype=torch.int8), "ns_dtype must be one of")])
def test_bad_settings_are_refused_with_the_rule(bad, rule):
    with pytest.raises(ValueError, match=rule.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        MuonSettings(**bad)


def test_exchange_on_one_rank_equals_local_matrices():
    """A flat tensor holding two matrices and a slice of a third: the exchange's plan with no group maps each whole
    unit as LocalMatrices does."""
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(2, 3, 5, dtype=torch.float64)
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    held = [Held(flat, 0, 24, "a", (4, 6), ((0, 0, 24),)), Held(flat, 24, 30, "b", (2, 3, 5), ((0, 0, 30),))]
    exchange = MatrixExchange(held, None, dtype=torch.float64)

    def step(m: torch.Tensor) -> torch.Tensor:
        return m * m.sum()

    out, = exchange.apply([(flat, flat)], step)
    want = LocalMatrices().apply([(a, a), (b, b)], step)
    assert torch.equal(out[:24].view(4, 6), want[0]) and torch.equal(out[24:].view(2, 3, 5), want[1])
    assert [s.shape for s in exchange.segments(flat)] == [(4, 6), (3, 5)]
    assert exchange.traffic() == (0, 0) and exchange.owner_flops == [newton_schulz_flops((4, 6))
                                                                     + 2 * newton_schulz_flops((3, 5))]


def test_adamw_with_16_bit_moments():
    """paratrain.optim.AdamW: moments in the parameters' dtype is torch.optim.AdamW bit for bit; in bfloat16 the
    state takes half the bytes and 10 steps at lr 0.01 stay within 1e-2 of float32 moments (relative to each
    tensor's largest weight; measured 1.6e-3)."""
    from paratrain.optim import AdamW

    def train(make) -> tuple[Net, torch.optim.Optimizer]:
        net = Net()
        opt = make(net.parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(10):
            x = torch.randint(0, 16, (12,), generator=g)
            opt.zero_grad()
            net(x).backward()
            opt.step()
        return net, opt

    ours, _ = train(lambda ps: AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1))
    theirs, _ = train(lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    low, opt = train(lambda ps: AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=torch.bfloat16))
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    worst = max(float(((a - b).abs().max() / b.abs().max()).detach()) for a, b in zip(low.parameters(),
                                                                                  theirs.parameters()))
    assert 0 < worst < 1e-2, worst


def test_an_optimizer_that_reads_whole_tensors_is_refused_where_the_layout_cuts_them():
    """torch.optim.Muon under ZeRO or tp would orthogonalise slices: refused by name with the fix; Muon under the
    parameter server too; paratrain's Muon and element-wise optimizers pass."""
    from paratrain.optim.matrices import check_layout_fits

    params = [nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match=r"Muon reads each parameter whole, and this layout gives it ZeRO-1's flat "
                                         r"shards and tensor-parallel slices.*paratrain.optim.Muon"):
        check_layout_fits(torch.optim.Muon(params), ["ZeRO-1's flat shards", "tensor-parallel slices"])
    with pytest.raises(ValueError, match="matrix optimizer: it needs each whole matrix"):
        check_layout_fits(Muon(params), ["the parameter server's slices"])
    check_layout_fits(torch.optim.Muon(params), [])  # plain dp or pp: whole tensors
    check_layout_fits(Muon(params), ["ZeRO-3's flat shards"])
    check_layout_fits(torch.optim.AdamW(params), ["tensor-parallel slices"])
