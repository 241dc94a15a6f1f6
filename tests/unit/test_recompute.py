"""Recompute wraps modules in place: the model's names and the modules themselves stay as they were,
and the results are bitwise those of the model without recompute."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import preset
from paratrain.memory import apply_recompute
from paratrain.memory.recompute import Recomputed, recomputed_names
from paratrain.models import build_gpt, lm_loss

TINY = preset("tiny")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, 1)


def losses_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(5)  # torch's own dropout draws from the global generator
    loss, _ = lm_loss(model, batch())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("pattern", [r"blocks\.\d+", r"blocks\.\d+\.attn\.core"], ids=["full", "selective"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_is_bitwise_and_keeps_names(pattern, dropout):
    reference = build_gpt(preset("tiny", dropout=dropout), seed=0)
    expected = losses_and_grads(reference)
    model = build_gpt(preset("tiny", dropout=dropout), seed=0)
    modules = list(model.modules())
    classes = [type(m) for m in modules]
    names = apply_recompute(model, pattern)
    assert names and recomputed_names(model) == names
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(model.state_dict()) == list(reference.state_dict())
    assert [type(m) for m in modules] == classes  # the modules themselves are not changed
    got = losses_and_grads(model)
    assert torch.equal(got[0], expected[0])
    for name, grad in expected[1].items():
        assert torch.equal(got[1][name], grad), name
    assert apply_recompute(model, pattern, required=False) == []  # wrapped once


def test_train_and_eval_reach_the_wrapped_module():
    model = build_gpt(TINY, seed=0)
    apply_recompute(model)
    model.eval()
    assert all(not m.training for m in model.modules())
    assert all(not m.wrapped.training for m in model.modules() if isinstance(m, Recomputed))
    model.train()
    assert all(m.wrapped.training for m in model.modules() if isinstance(m, Recomputed))
