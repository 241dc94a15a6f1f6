"""Document masking (paratrain.nn.documents): packed windows train as their documents would apart.

The oracle is plain PyTorch in one process that never packs: each document of each window runs through the
model alone (positions 0 .. n-1, causal), its tokens' cross-entropies summed. A layout trained on the packed
windows (positions restarting at each document, attention inside it, no loss on a next document's first token)
must give its per-step losses, gradient norms and final weights (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paratrain.data import GlobalBatchLoader
from paratrain.data.loader import document_positions
from paratrain.nn.documents import document_mask, positions_after
from tests.helpers import lr_at, max_state_diff, plain_token_step, rel_diff
from tests.margins import within

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 16, 64


def stream() -> tuple[np.ndarray, np.ndarray]:
    """Tokens of documents 1 to 20 tokens long back to back, and where each starts."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 21, size=60)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return rng.integers(0, VOCAB, size=int(lengths.sum())), starts


def batch(step: int, dp: int = 1, index: int = 0) -> tuple[torch.Tensor, ...]:
    """dp rank `index`'s rows of step `step`'s global batch: (inputs, targets, positions)."""
    tokens, starts = stream()
    loader = GlobalBatchLoader(tokens, seq_len=SEQ, global_batch=GLOBAL_BATCH, dp=1, dp_index=0, seed=0,
                               document_starts=starts)
    whole = loader.gather(list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)))
    rows = GLOBAL_BATCH // dp
    return tuple(t[index * rows: (index + 1) * rows] for t in whole)


def build(kind: str) -> torch.nn.Module:
    if kind == "gpt":
        import paratrain
        from paratrain.config import preset

        return paratrain.build_gpt(preset("tiny", seq_len=SEQ, vocab_size=VOCAB), seed=3, dtype=torch.float64)
    from tests.distributed.test_hf import build as build_hf

    return build_hf(kind)


def logits_of(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    if hasattr(model, "output"):  # the GPT: the real vocabulary of its padded logits
        return model(ids, positions)[..., :VOCAB]
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits


def apart(model: torch.nn.Module, inputs: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the logits of its documents, each run through the model alone, back to back [S, V]."""
    rows = []
    for ids, pos in zip(inputs, positions):
        cuts = [*torch.nonzero(pos == 0).flatten().tolist(), len(ids)]
        rows.append(torch.cat([logits_of(model, ids[None, a:b])[0] for a, b in zip(cuts, cuts[1:])]))
    return rows


_PLAIN: dict[str, dict] = {}


def plain(kind: str) -> dict:
    """The oracle: the model trained by plain PyTorch on the documents apart (sum of token losses
    backpropagated, gradients divided by the count, as the engine does)."""
    if kind not in _PLAIN:
        model = build(kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.1)
        losses, norms = [], []
        for step in range(STEPS):
            inputs, targets, positions = batch(step)
            loss, norm = plain_token_step(model, optimizer, torch.stack(apart(model, inputs, positions)), targets,
                                          lr_at(step))
            losses.append(loss)
            norms.append(norm)
        # a tied head is one tensor in paratrain's state, under the embedding's name
        whole = model.state_dict()
        tied = {k for k in ("lm_head.weight", "head.weight") if k in whole and any(
            whole[k].data_ptr() == v.data_ptr() for name, v in whole.items() if name != k)}
        state = {k: v.detach().clone() for k, v in whole.items() if k not in tied}
        _PLAIN[kind] = {"losses": losses, "grad_norms": norms, "model": state}
    return _PLAIN[kind]


def _job(kind: str, **layout) -> dict:
    import paratrain

    micro_batch = layout.pop("micro_batch", None)
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(**layout))
    model = build(kind)
    if kind == "gpt":
        loss_fn, recipe = paratrain.models.lm_loss, None
    else:
        from paratrain.models.hf import LLAMA_RECIPE, llama_loss
        from paratrain.models.hf_gpt2 import GPT2_RECIPE

        loss_fn, recipe = llama_loss, GPT2_RECIPE if kind == "gpt2" else LLAMA_RECIPE
    engine = paratrain.parallelize(model, ctx, optimizer=lambda p: torch.optim.AdamW(p, lr=lr_at(0), weight_decay=0.1),
                                   options=paratrain.EngineOptions(micro_batch=micro_batch), recipe=recipe)
    logits = None
    if kind != "gpt" and ctx.mesh.degree("pp") == ctx.mesh.degree("cp") == 1:  # HF's lm_head gathers the logits
        # whole on every tp rank (a cp rank's are its part of the sequence)
        inputs, _, positions = batch(0)
        with torch.no_grad():
            logits = logits_of(engine.model, inputs, positions)
    losses, norms = [], []
    for step in range(STEPS):
        engine.set_lr(lr_at(step))
        losses.append(engine.train_step(batch(step, ctx.mesh.degree("dp"), ctx.mesh.index("dp")), loss_fn))
        norms.append(engine.last.grad_norm)
    return {"losses": losses, "grad_norms": norms, "model": engine.state_dict()["model"], "logits": logits}


# Bounds 1e-12 (the float64 parity bound of the other layout tests). Measured (AMD EPYC, 2 cores, torch 2.13 CPU,
# native and ATEN_CPU_CAPABILITY=default kernels): see the values next to each check.
@pytest.mark.parametrize("kind,layout", [
    ("gpt", dict(tp=2, sequence_parallel=True, micro_batch=4)),  # the mask after the sequence gather
    ("gpt", dict(pp=2, micro_batch=2)),  # positions read on every stage from its copy of the micro-batch
    ("gpt", dict(dp=2, zero=3, micro_batch=2)),
    ("llama-tied", dict(tp=2, micro_batch=4)),  # HF finds the documents from restarting position ids
    ("llama-tied", dict(pp=2, micro_batch=2)),  # ... and the pipeline's runner builds HF's mask from them
    ("gpt2", dict(pp=2, micro_batch=2)),  # learned positions: wpe indexed by each document's positions
    ("gpt", dict(cp=2, micro_batch=4)),  # ring: each block masked by its queries' document positions
    ("gpt", dict(cp=2, cp_mode="ulysses", micro_batch=4)),  # Ulysses: the positions gathered with the sequence
    ("llama-tied", dict(cp=2, micro_batch=4)),  # HF under ring: the documents' positions passed to its attention
    ("llama", dict(cp=2, cp_mode="ulysses", micro_batch=4)),  # ... and Ulysses, GQA
    ("llama", dict(cp=2, pp=2, micro_batch=2)),  # the pipeline's runner: rotary at the documents' positions
    ("llama", dict(cp=4, cp_mode="usp", cp_ulysses=2, micro_batch=4)),  # USP: gathered over Ulysses, masked per
    # block; GQA's kv heads split over Ulysses
    ("gpt2", dict(cp=2, micro_batch=4)),  # learned positions read at the documents' positions, ring attention
    ("gpt2", dict(cp=4, cp_mode="usp", cp_ulysses=2, micro_batch=4)),
    # the document-aware split (cp_balance documents): every micro-batch cut by its documents' work, here at one
    # token a piece, so each rank's positions are scattered over the window and travel with the micro-batch
    ("gpt", dict(cp=2, tp=2, sequence_parallel=True, cp_balance="documents", micro_batch=4)),
    ("llama-tied", dict(cp=2, cp_balance="documents", micro_batch=1)),  # one row: the fused kernel, runs cut at documents
    ("llama", dict(cp=2, cp_mode="ulysses", pp=2, cp_balance="documents", micro_batch=2)),
    ("gpt2", dict(cp=4, cp_mode="usp", cp_ulysses=2, cp_balance="documents", micro_batch=4)),
], ids=["gpt-tp2-sp", "gpt-pp2", "gpt-zero3", "llama-tp2", "llama-pp2", "gpt2-pp2", "gpt-cp2-ring", "gpt-cp2-ulysses",
        "llama-cp2-ring", "llama-cp2-ulysses", "llama-cp2-pp2", "llama-cp4-usp", "gpt2-cp2-ring",
        "gpt2-cp4-usp", "balanced-gpt-cp2-tp2-sp", "balanced-llama-cp2-ring", "balanced-llama-cp2-ulysses-pp2",
        "balanced-gpt2-cp4-usp"])
def test_packed_documents_train_as_apart(pools, kind, layout):
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    got = pools(world).run(_job, kind, **layout)
    ref = plain(kind)
    for rank in got:
        within(rel_diff(rank["losses"], ref["losses"]), 1e-12, "loss (float64)")
        within(rel_diff(rank["grad_norms"], ref["grad_norms"]), 1e-12, "grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "weights (float64)")
    if got[0]["logits"] is not None:  # before training: the packed window's logits are its documents' own
        inputs, _, positions = batch(0)
        with torch.no_grad():
            separate = torch.stack(apart(build(kind), inputs, positions))
        for rank in got:  # measured 3.1e-16 of the largest (Llama tp 2)
            within(float((rank["logits"] - separate).abs().max() / separate.abs().max()), 2e-15,
                   "logits under the layout (float64, of the largest)")


@pytest.mark.parametrize("kind", ["gpt", "llama-tied", "mistral", "gpt2"])
def test_packed_logits_are_the_documents_logits(kind):
    """One process: the logits of a packed window are its documents' own, run apart (float64)."""
    model = build(kind)
    inputs, _, positions = batch(0)
    with torch.no_grad():
        packed = logits_of(model, inputs, positions)
        separate = torch.stack(apart(model, inputs, positions))
    # measured <= 6.4e-16 of the largest logit (GPT-2; 3.8e-16 GPT, 3.1e-16 Llama; avx2 and default kernels): the
    # masked kernel sums other lengths than the short sequences'; the bound keeps a 3x margin
    within(float((packed - separate).abs().max() / separate.abs().max()), 2e-15, "logits (float64, of the largest)")


def test_loader_positions_and_targets():
    """Positions restart at each document (from the window's start for the one begun before it), and the
    target that is another document's first token is not predicted."""
    tokens = np.arange(20)
    starts = np.array([0, 3, 4, 11])  # documents [0, 3), [3, 4), [4, 11), [11, 20)
    positions, crossing = document_positions(np.array([0, 6]), 8, starts)
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2]]
    assert crossing.tolist() == [[False, False, True, True, False, False, False, False],
                                 [False, False, False, False, True, False, False, False]]
    loader = GlobalBatchLoader(tokens, seq_len=8, global_batch=2, dp=1, dp_index=0, seed=0, shuffle=False,
                               document_starts=starts)
    inputs, targets, got = loader.next()
    assert got.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4]]
    assert targets.tolist() == [[1, 2, -100, -100, 5, 6, 7, 8], [9, 10, -100, 12, 13, 14, 15, 16]]
    assert inputs[1].tolist() == list(range(8, 16))


def test_positions_after_eos_and_the_mask():
    eos = 0
    ids = torch.tensor([[5, 6, eos, 7, eos, eos, 8, 9]])
    positions = positions_after(ids, eos)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    mask = document_mask(positions)[0, 0]
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[7].tolist() == [False] * 6 + [True, True]


def test_one_mask_is_kept_for_every_layer():
    """The GPT builds its document mask once per forward and every attention shares it (paratrain.nn.documents.
    Documents): what masking adds to the bytes kept for backward is one additive float32 mask [B, 1, S, S] and
    each layer's gathered rotary rows [B, 1, S, hd / 2] (cos and sin), less the rotary tables the causal run
    keeps as views, to the byte (a mask per layer would add (L - 1) B S^2 x 4 more)."""
    from paratrain.memory import saved_activations

    model = build("gpt").float()
    config = model.config
    inputs, _, positions = batch(0)
    kept = {}
    for name, args in (("causal", (inputs,)), ("documents", (inputs, positions))):
        with saved_activations(model) as saved:
            model(*args)
        kept[name] = saved.bytes
    b, s, half = inputs.shape[0], inputs.shape[1], config.head_dim // 2
    expected = b * s * s * 4 + 2 * config.n_layer * b * s * half * 4 - 2 * config.seq_len * half * 4
    assert kept["documents"] - kept["causal"] == expected


def _refusal(preset_name: str, overrides: dict) -> str | None:
    import paratrain
    from paratrain.config import ConfigError, preset

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(cp=2, cp_balance="documents"))
    model = paratrain.build_gpt(preset(preset_name, seq_len=SEQ, vocab_size=VOCAB, **overrides), seed=3)
    try:
        engine = paratrain.parallelize(model, ctx, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    except ConfigError as error:
        return str(error)
    inputs, targets, positions = batch(0)
    with pytest.raises(ValueError, match="integers \\[rows, seq\\] as the third"):  # a float third tensor is no
        engine.train_step((inputs, targets, positions.double()), paratrain.models.lm_loss)  # documents' positions
    return None


@pytest.mark.parametrize("preset_name,overrides,needle", [
    ("tiny", dict(dropout=0.1), "dropout 0.1 draws its masks at the fixed split's positions"),
    ("tiny", dict(mtp_depth=1), "multi-token prediction shifts its inputs and labels"),
    ("tiny-moe", dict(capacity_factor=1.25), "expert capacity (1.25) counts tokens in the fixed split's order"),
    ("tiny", {}, None),
], ids=["dropout", "mtp", "capacity", "none"])
def test_the_document_split_refuses_what_reads_the_fixed_split(pools, preset_name, overrides, needle):
    """What draws or gathers at the fixed split's positions (the [B, S, D] dropout masks, MTP's shift, per-sequence
    expert capacity) cannot follow a split that changes by micro-batch: paratrain.parallelize refuses it with the
    rule (the run's checks say it before launch, tests/unit/test_config.py); a float third tensor is refused too."""
    for message in pools(2).run(_refusal, preset_name, overrides):
        assert (message is None) if needle is None else (needle in message), message
