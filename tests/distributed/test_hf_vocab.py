"""A vocabulary tensor parallelism does not divide (63 under tp 2, as GPT-2's 50,257): padded on load with
zero rows the loss never reads, so training is plain PyTorch's on the unpadded model, and trimmed on export."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from tests.distributed.test_hf import batch as hf_batch  # noqa: E402
from tests.helpers import lr_at, plain_token_step  # noqa: E402
from tests.margins import within  # noqa: E402

VOCAB, STEPS = 63, 3


def batch(step: int, dp: int = 1, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, labels = hf_batch(step, dp, index)
    return inputs % VOCAB, labels.where(labels < 0, labels % VOCAB)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True,
                                         use_cache=False, attn_implementation="sdpa"))
    out = tmp_path_factory.mktemp("odd-vocab")
    model.save_pretrained(out, max_shard_size="20KB")
    return str(out)


def _adamw(params):
    return torch.optim.AdamW(params, lr=lr_at(0), weight_decay=0.1)


def _padded(folder: str, root: str) -> dict:
    import paratrain
    import paratrain.hf
    from paratrain.checkpoint.sharded import save_sharded

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(tp=2))
    pretrained = paratrain.hf.from_pretrained(folder, dtype=torch.float64, pad_vocab_to=2)
    engine = paratrain.parallelize(pretrained.model, ctx, optimizer=_adamw,
                                   options=paratrain.EngineOptions(micro_batch=4), recipe=pretrained.recipe,
                                   init=pretrained.init)
    loaded = engine.state_dict()["model"]["model.embed_tokens.weight"].clone()
    losses = []
    for step in range(STEPS):
        engine.set_lr(lr_at(step))
        losses.append(engine.train_step(batch(step), pretrained.loss))
    save_sharded(root, STEPS, engine.view(), {})
    return {"loaded": loaded, "losses": losses, "state": engine.state_dict()["model"]}


def test_a_padded_vocabulary_trains_as_the_unpadded_model_and_exports_trimmed(pools, folder, tmp_path):
    """Loaded under tp 2 the embedding holds 64 rows, the last zeros; 3 AdamW steps give plain PyTorch's losses
    and weights on the 63-entry model (float64: measured 2.1e-16 loss, 8.0e-17 weights, avx2 and default kernels; bound 1e-12), the padding
    row stays zero, and the export holds 63 rows that transformers loads with nothing mismatched."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from paratrain.hf import export_pretrained

    got = pools(2).run(_padded, folder, str(tmp_path / "ckpt"))[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="sdpa")
    assert got["loaded"].shape == (64, 32) and not got["loaded"][63].any()
    assert torch.equal(got["loaded"][:VOCAB], model.model.embed_tokens.weight.detach())
    optimizer, losses = _adamw(model.parameters()), []
    for step in range(STEPS):
        inputs, labels = batch(step)
        logits = model(input_ids=inputs, use_cache=False).logits
        losses.append(plain_token_step(model, optimizer, logits, labels, lr_at(step))[0])
    within(max(abs(a - b) / b for a, b in zip(got["losses"], losses)), 1e-12, "loss (float64)")
    trained = got["state"]
    assert not trained["model.embed_tokens.weight"][VOCAB:].any()  # the padding row never moved
    reference = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    diff = max(float((trained[k][: v.shape[0]] - v).abs().max()) for k, v in reference.items())
    within(diff, 1e-12, "weights (float64)")
    export_pretrained(tmp_path / "ckpt", tmp_path / "out", source=folder, max_shard_size="30KB")
    exported = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(str(file)))
    assert exported["model.embed_tokens.weight"].shape == (VOCAB, 32) and "lm_head.weight" not in exported
    assert torch.equal(exported["model.embed_tokens.weight"], trained["model.embed_tokens.weight"][:VOCAB])
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert loaded.config.vocab_size == VOCAB and math.isfinite(float(loaded(input_ids=batch(0)[0]).logits.sum()))


def test_an_undivided_vocabulary_without_padding_names_the_fix(folder):
    from transformers import AutoConfig

    from paratrain.config import ConfigError
    from paratrain.models.hf import check_llama_tp

    with pytest.raises(ConfigError, match=r"vocab_size \(63\).*pad_vocab_to=2"):
        check_llama_tp(AutoConfig.from_pretrained(folder), 2)


def test_the_cli_pads_alike_for_every_tp_dividing_128(folder):
    """--hf and Trainer(hf=) pad to vocab_multiple(tp): 128 rows for tp 1, 2, 4 and 8 alike, so a checkpoint
    saved under one resumes under another; a vocabulary already divisible stays as the files hold it."""
    import paratrain.hf
    from paratrain.hf.load import vocab_multiple

    rows = {paratrain.hf.from_pretrained(folder, pad_vocab_to=vocab_multiple(tp)).model.model.embed_tokens.weight.shape[0]
            for tp in (1, 2, 4, 8)}
    assert rows == {128} and vocab_multiple(3) == 384


def test_gpt2_dropout_under_tp_is_refused():
    """transformers draws GPT-2's dropout from each rank's generator: under tp the replicated activations would
    differ between ranks, so tp > 1 with dropout is refused with the fix."""
    from transformers import GPT2Config

    from paratrain.config import ConfigError
    from paratrain.models.hf_gpt2 import check_gpt2_tp

    check_gpt2_tp(GPT2Config(vocab_size=64, n_embd=32, n_head=4), 1)  # tp 1: its own generator, nothing to agree
    with pytest.raises(ConfigError, match=r"resid_pdrop.*tp 2.*set resid_pdrop, embd_pdrop and attn_pdrop to 0"):
        check_gpt2_tp(GPT2Config(vocab_size=64, n_embd=32, n_head=4), 2)
