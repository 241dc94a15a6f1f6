from __future__ import annotations

import torch

from paratrain.config import preset
from paratrain.models import GPT, build_gpt, lm_loss

TINY = preset("tiny", seq_len=16)


def test_shapes_and_tied_head():
    model = build_gpt(TINY, seed=0)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params()
    untied = preset("tiny", tie_embeddings=False)
    assert sum(p.numel() for p in build_gpt(untied, seed=0).parameters()) == untied.num_params()


def test_init_is_keyed_by_seed_and_name_only():
    torch.manual_seed(1)
    a = build_gpt(TINY, seed=5)
    torch.manual_seed(2)
    torch.randn(1000)  # other draws must not matter
    b = build_gpt(TINY, seed=5)
    c = build_gpt(TINY, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # a deeper model shares the first blocks' init: values depend on the name, not on the neighbours
    deeper = build_gpt(preset("tiny", seq_len=16, n_layer=6), seed=5)
    assert torch.equal(deeper.blocks[1].mlp.up.weight, a.blocks[1].mlp.up.weight)


def test_causal():
    model = build_gpt(TINY, seed=0, dtype=torch.float64)
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    assert torch.allclose(model(x)[0, :10], model(y)[0, :10])


def test_loss_is_a_sum_with_its_count():
    model = build_gpt(TINY, seed=0)
    x = torch.randint(0, 256, (3, 16))
    y = torch.randint(0, 256, (3, 16))
    y[0, :4] = -100
    total, count = lm_loss(model, (x, y))
    assert int(count) == 44
    mean = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(total / count, mean)


def test_generate_appends_tokens():
    model = build_gpt(TINY, seed=0)
    out = model.generate(torch.tensor([[1, 2, 3]]), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 23) and torch.equal(out[0, :3], torch.tensor([1, 2, 3]))


def test_bf16_autocast_runs_on_cpu():
    model = build_gpt(TINY, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = lm_loss(model, (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))))
    assert total.dtype == torch.float32 and torch.isfinite(total)


def test_big_presets_build_on_meta():
    with torch.device("meta"):
        model = GPT(preset("gpt3-xl"))
    assert sum(p.numel() for p in model.parameters()) == preset("gpt3-xl").num_params()


def test_generate_padded_to_a_multiple_samples_the_same():
    """Right padding (for sequence-split strategies) never changes what the real positions see."""
    model = build_gpt(preset("tiny"), seed=0).eval()
    prompt = torch.tensor([[5, 6, 7]])
    plain = model.generate(prompt, 9, generator=torch.Generator().manual_seed(1))
    padded = model.generate(prompt, 9, generator=torch.Generator().manual_seed(1), pad_to=4)
    assert torch.equal(plain, padded)


def test_padded_vocabulary_changes_nothing_but_shapes():
    """vocab_multiple pads the embedding and head; padding rows are out of the softmax and never
    sampled, so the loss equals the unpadded model's with the same real rows."""
    config = preset("tiny", vocab_size=250)
    plain, padded = build_gpt(config, seed=0), build_gpt(preset("tiny", vocab_size=250, vocab_multiple=64), seed=0)
    assert padded.tok_emb.weight.shape[0] == 256
    with torch.no_grad():
        padded.load_state_dict({k: v if v.shape == plain.state_dict()[k].shape else
                                torch.cat((plain.state_dict()[k], v[250:])) for k, v in padded.state_dict().items()})
    x = torch.randint(0, 250, (2, 16))
    a, b = lm_loss(plain, (x, x.roll(-1, 1))), lm_loss(padded, (x, x.roll(-1, 1)))
    assert torch.allclose(a[0], b[0], rtol=1e-6) and a[1] == b[1]
    assert padded.output.full(padded(x)).shape[-1] == 250
