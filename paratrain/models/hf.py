"""Hugging Face causal LMs (transformers' LlamaForCausalLM and MistralForCausalLM) under paratrain.

    pip install 'paratrain[hf]'
    from paratrain.models.hf import LLAMA_RECIPE, check_llama_tp, llama_loss
    engine = paratrain.parallelize(model, ctx, optimizer=..., recipe=LLAMA_RECIPE)

The model stays HF's own module; strategies read it by module name, as they read the GPT. The names
are the contract (the same in both classes):

    model.embed_tokens                         Embedding[V, D]
    model.layers.{i}.input_layernorm           RMSNorm[D]
    model.layers.{i}.self_attn.q_proj          Linear D -> H * hd       (H: num_attention_heads)
    model.layers.{i}.self_attn.k_proj / v_proj Linear D -> KV * hd      (KV: num_key_value_heads)
    model.layers.{i}.self_attn.o_proj          Linear H * hd -> D
    model.layers.{i}.post_attention_layernorm  RMSNorm[D]
    model.layers.{i}.mlp.gate_proj / up_proj   Linear D -> F
    model.layers.{i}.mlp.down_proj             Linear F -> D
    model.norm                                 RMSNorm[D]
    model.rotary_emb                           cos/sin from position ids (buffers only, no parameters)
    lm_head                                    Linear D -> V

Batch convention: (input_ids[B, S], labels[B, S]), labels already aligned to the outputs:
labels[b, t] is the token position t must predict (the next one), -100 where nothing is predicted.
It is paratrain's own (GlobalBatchLoader: windows of S + 1 tokens, inputs the first S, labels the
last S), so no loss shifts anything and a pipeline's last stage computes the loss from its logits
alone. HF's `model(input_ids=ids, labels=ids)` shifts inside instead; the same tokens in this
convention are input_ids = ids[:, :-1], labels = ids[:, 1:] (the test checks both losses agree).

transformers is imported inside functions only: `import paratrain` never imports it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.models.hf_context import DOCUMENTS_KEY, SHARD_KEY, PositionsOf, llama_split_sequence
from paratrain.models.hf_experts import hf_expert_banks
from paratrain.nn.documents import Documents
from paratrain.nn.loss import VocabOutput
from paratrain.nn.recipe import Layer, Recipe, Run, stage_loss

LLAMA_TP_PLAN: dict[str, str] = {
    # Both vocabulary ends split along the vocabulary (dim 0 of their weights), so a tied model
    # (tie_word_embeddings=True: one Parameter for both) stays tied: ids outside a rank's rows read
    # zeros, and the rows are summed over tp.
    "embed_tokens": "embedding",
    # q[B, S, D] @ Wq[D, H/tp * hd] -> [B, S, H/tp * hd]: whole heads, since HF views the projection as
    # [B, S, -1, hd] (the local head count is inferred) and repeats k/v by H / KV, a ratio tp keeps
    # when both H and KV are divisible by tp (check_llama_tp).
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "self_attn.o_proj": "row",  # [B, S, H/tp * hd] @ Wo[H/tp * hd, D] -> partial [B, S, D], summed over tp
    "mlp.gate_proj": "column",  # silu(gate) * up is element-wise, so both split alike along F
    "mlp.up_proj": "column",
    "mlp.down_proj": "row",
    "lm_head": "column_gather",  # W[V/tp, D] per rank, logits all-gathered to [B, S, V]
    "input_layernorm": "norm",  # replicated under 1d; cut along the width with the grid modes
    "post_attention_layernorm": "norm",
    "model.norm": "norm",
}
"""The Megatron layout of HF Llama / Mistral: one all-reduce per attention and per MLP, each way,
and one for the embedding.

The output end is not vocab-parallel as the GPT's is: paratrain's "vocab_output" style reads split
logits through paratrain's VocabOutput module, which HF's model has not (its logits leave through
lm_head, and any loss then wants them whole). So lm_head is "column_gather" (its weight split, the
logits gathered: every tp rank holds the [B, S, V] logits and computes the same loss, as HF's own tp
plan does, "colwise_gather_output"). model.embed_tokens is vocab-parallel ("embedding": its rows
split alike), which keeps a tied head tied; its padding row, if any, keeps a zero gradient on the
rank that holds it. Sequence parallelism is not supported (check_llama_tp says why)."""

LLAMA_WRAP = r"model\.layers\.\d+"
"""ZeRO-3 units: each decoder layer (parallelize's `wrap=`); the root unit holds the embedding, the
final norm and lm_head."""

_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
          "deepseek_v3", "gpt_oss")


def check_llama_tp(config: Any, tp: int, *, sequence_parallel: bool = False, pad_vocab: bool = False) -> None:
    """Raise ConfigError unless LLAMA_TP_PLAN applies to a model of this HF config at this tp degree
    (pad_vocab: the vocabulary will be padded to a multiple of tp, paratrain.hf.from_pretrained(pad_vocab_to=))."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ffn, vocab = config.intermediate_size, config.vocab_size
    fits = [t for t in range(1, math.gcd(heads, kv, ffn) + 1) if math.gcd(heads, kv, ffn) % t == 0]
    if heads % tp or kv % tp:
        raise ConfigError(f"tensor parallelism splits attention by whole heads: num_attention_heads ({heads}) and "
                          f"num_key_value_heads ({kv}) must both be divisible by tp ({tp}); use tp in {fits}")
    if ffn % tp:
        raise ConfigError(f"the MLP splits along intermediate_size ({ffn}), which must be divisible by tp ({tp}); "
                          f"use tp in {fits}")
    if vocab % tp and not pad_vocab:
        raise ConfigError(f"model.embed_tokens and lm_head split along vocab_size ({vocab}), which must be divisible "
                          f"by tp ({tp}): load with paratrain.hf.from_pretrained(folder, pad_vocab_to={tp}) (zero rows "
                          "the loss never reads; `paratrain train --hf` pads), or drop 'embed_tokens' and 'lm_head' "
                          "from the plan to keep them replicated")
    if sequence_parallel:
        raise ConfigError("sequence parallelism does not apply to HF Llama / Mistral: their attention reshapes each "
                          "projection with the sequence length of its input, which sequence parallelism splits "
                          "while the projections gather it, and their embedding is replicated; set "
                          "sequence_parallel=False")


def llama_pipeline_loss(logits: torch.Tensor, labels: torch.Tensor, *,
                        vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token cross-entropies, number of labels that are not -100) from logits[B, S, V] and
    labels[B, S] aligned to them (no shift): parallelize's `pipeline_loss=` under pp. vocab: the real
    vocabulary, when the logits' last columns are padding (from_pretrained(pad_vocab_to=)).

    In float32 at least, by row chunks (paratrain.nn.loss: bf16 logits never upcast whole)."""
    return VocabOutput(vocab or logits.shape[-1]).loss(logits, labels)


def llama_loss(model: nn.Module, batch: Any, *, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's loss_fn for an HF causal LM: batch (input_ids, labels) in the module's convention, or
    (input_ids, labels, positions) of packed documents (paratrain.nn.documents: HF reads restarting position
    ids as packed sequences and masks attention at their borders; under context parallelism paratrain.models.
    hf_context's attention does); the same numbers as llama_pipeline_loss on
    the last pipeline stage."""
    input_ids, labels, *positions = batch
    logits = model(input_ids=input_ids, position_ids=positions[0] if positions else None, use_cache=False).logits
    return llama_pipeline_loss(logits, labels, vocab=vocab)


def llama_layers(model: nn.Module) -> list[Layer]:
    """An HF Llama / Mistral causal LM as pipeline layers (parallelize's `layers=`):

        model.embed_tokens | model.layers.0 | ... | model.layers.{L-1} | model.norm + lm_head

    Each decoder layer runs as LlamaModel.forward runs it for a batch without padding or cache:
    position ids 0 .. S-1 (or the micro-batch's packed-document positions), HF's causal mask (sliding-window
    for Mistral; per document) and rotary cos/sin from model.model.rotary_emb. Between stages travels only the
    hidden state [B, S, D]. A tied lm_head
    (tie_word_embeddings=True) on another stage than model.embed_tokens is kept tied by the stages
    (paratrain.pipeline.stages: a copy whose gradient is summed with the embedding's)."""
    config = model.config
    if config.model_type not in _TYPES:
        raise ConfigError(f"llama_layers cuts {' or '.join(_TYPES)} models (its layers run as theirs do), not "
                          f"model_type {config.model_type!r}: express the model as nn.Sequential of its layers")
    base = model.model
    d, v = config.hidden_size, config.vocab_size
    layers = [Layer("model.embed_tokens", {"model.embed_tokens": base.embed_tokens}, _embed, 2.0 * d, positions=True)]
    for i, block in enumerate(base.layers[: config.num_hidden_layers]):
        name = f"model.layers.{i}"
        # model.rotary_emb rides along with every decoder layer, under its own name: the StageModel of
        # any rank holding a layer then holds it once (one module, registered once per name), so cos/sin
        # come from HF's own code (its rope type and scaling), move with the stage (.to(device)), and stay
        # out of checkpoints (non-persistent buffers, no parameters).
        # Cost: forward FLOPs per token of the layer's matmuls (2 per weight); attention scores are the
        # same for every layer, so leaving them out shifts only the balance against the two ends.
        matmuls = sum(p.numel() for p in block.parameters() if p.dim() == 2)
        layers.append(Layer(name, {name: block, "model.rotary_emb": base.rotary_emb},
                            _decoder_runner(name, config, i), 2.0 * matmuls, positions=True))
    layers.append(Layer("lm_head", {"model.norm": base.norm, "lm_head": model.lm_head}, _head_runner(config),
                        2.0 * d * v, positions=True))
    return layers


def _embed(stage: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    return stage.get_submodule("model.embed_tokens")(input_ids)  # [B, S] -> [B, S, D]


def _head_runner(config: Any) -> Run:
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 / 3: logits = cap * tanh(logits / cap)

    def head(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        logits = stage.get_submodule("lm_head")(stage.get_submodule("model.norm")(x))  # [B, S, D] -> [B, S, V]
        return torch.tanh(logits / cap) * cap if cap else logits

    return head


def _layer_type(config: Any, index: int) -> str:
    """'sliding_attention' or 'full_attention': the config's layer_types (Gemma 2 / 3 alternate), else Mistral's
    window on every layer."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    return "sliding_attention" if sliding else "full_attention"


def _decoder_runner(name: str, config: Any, index: int) -> Run:
    layer_type = _layer_type(config, index)
    per_type = config.model_type == "gemma3_text"  # its rotary embedding differs by layer type (local / global)

    def run(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        rotary, extra = stage.get_submodule("model.rotary_emb"), {}
        if isinstance(rotary, PositionsOf):  # cp: attention is handed this rank's split
            extra[SHARD_KEY] = rotary.shard
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, S]: 0 .. S-1 (cp: mapped)
        elif isinstance(rotary, PositionsOf):  # cp: documents' positions are each token's own, not to be mapped
            rotary, extra[DOCUMENTS_KEY] = rotary.at, positions  # (a Documents under the document-aware split)
            positions = Documents.tensor(positions)
        mask = _causal_mask(config, x, positions, layer_type)  # None under sdpa without documents (causal itself)
        cos_sin = rotary(x, positions, layer_type) if per_type else rotary(x, position_ids=positions)  # 2 x [1, S, hd]
        out = stage.get_submodule(name)(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                                        **extra)
        return out[0] if isinstance(out, tuple) else out  # [B, S, D] (older transformers return a tuple)

    return run


def _causal_mask(config: Any, x: torch.Tensor, positions: torch.Tensor, layer_type: str) -> Any:
    """The mask LlamaModel / MistralModel.forward builds for inputs without padding or cache (from restarting
    positions, packed documents: transformers' masking_utils finds their borders)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    build = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
    return build(config, x, None, None, position_ids=positions)  # (config, embeds, attention mask, cache): none of the two


LLAMA_RECIPE = Recipe(tp_plan=LLAMA_TP_PLAN, blocks=LLAMA_WRAP, layers=llama_layers,
                      stage_loss=stage_loss(llama_pipeline_loss), hidden_size=lambda model: model.config.hidden_size,
                      split_sequence=llama_split_sequence)
"""HF Llama / Mistral's recipe (paratrain.nn.recipe), in one argument: parallelize(model, ctx, ...,
recipe=LLAMA_RECIPE) or Trainer(..., recipe=LLAMA_RECIPE) instead of tp_plan=, wrap=, layers= and
pipeline_loss= one by one. Its blocks (each decoder layer) are ZeRO-3's units, what recompute='full'
recomputes and what compile compiles."""

QWEN3_TP_PLAN: dict[str, str] = {**LLAMA_TP_PLAN, "self_attn.q_norm": "head_partial", "self_attn.k_norm": "head_partial"}
"""Qwen3: Llama's layout, and its per-head q / k RMSNorms kept whole on every tp rank; each rank runs them on
its own heads, so their gradients are partial and summed over tp ("head_partial")."""

QWEN3_RECIPE = dataclasses.replace(LLAMA_RECIPE, tp_plan=QWEN3_TP_PLAN)
"""HF Qwen3's recipe (Qwen2, with biased q / k / v projections that split with them, takes LLAMA_RECIPE)."""


_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MOE_RECIPE = dataclasses.replace(LLAMA_RECIPE, tp_plan={k: v for k, v in LLAMA_TP_PLAN.items() if k not in _MLP},
                                 expert_banks=hf_expert_banks)
"""HF Mixtral and Qwen2-MoE: Llama's attention layout; the router and the experts (stacked [E, 2I, D] and [E, D, I],
paratrain.hf.files) and Qwen2-MoE's shared expert whole on every tp rank (their input is whole there: the attention's
row-parallel output is summed first), so each rank computes them alike and their gradients need no sum over tp."""

QWEN3_MOE_RECIPE = dataclasses.replace(QWEN3_RECIPE, tp_plan={k: v for k, v in QWEN3_TP_PLAN.items() if k not in _MLP},
                                       expert_banks=hf_expert_banks)
"""HF Qwen3-MoE: Qwen3's attention (per-head q / k norms), experts as MOE_RECIPE's."""

DEEPSEEK_TP_PLAN: dict[str, str] = {
    **{k: v for k, v in LLAMA_TP_PLAN.items() if not k.startswith("self_attn.")},  # the dense first layers' MLP
    # multi-head latent attention: x -> q_a_proj -> q_a_layernorm -> q_b_proj [H * (nope + rope)] per head, and
    # x -> kv_a_proj_with_mqa -> [compressed kv | k_pe], the compressed part -> kv_a_layernorm -> kv_b_proj
    # [H * (nope + v)] per head, k_pe (the rotary key) shared by every head. Heads split over tp: the two up
    # projections "column_partial", the down projections and their norms whole on every rank, whose gradients are
    # partial there (each rank's heads only, k_pe's included) and summed over tp, the input's once.
    "self_attn.q_a_proj": "partial_linear",
    "self_attn.q_a_layernorm": "head_partial",
    "self_attn.q_b_proj": "column_partial",
    "self_attn.kv_a_proj_with_mqa": "partial_linear",
    "self_attn.kv_a_layernorm": "head_partial",
    "self_attn.kv_b_proj": "column_partial",
    "self_attn.o_proj": "row",
}
"""HF DeepSeek-V3 under tp (with q_lora_rank: DeepSeek-V3 / R1's compressed queries, and at least one dense layer,
first_k_dense_replace > 0, so that every entry names a module): the experts as MOE_RECIPE's."""

DEEPSEEK_RECIPE = dataclasses.replace(MOE_RECIPE, tp_plan=DEEPSEEK_TP_PLAN)

GPT_OSS_RECIPE = dataclasses.replace(MOE_RECIPE, tp_plan={**MOE_RECIPE.tp_plan, "self_attn": "head_vector"})
"""HF gpt-oss (cp refused by name: its attention sinks are not in the ring / Ulysses attentions): the Llama recipe's
blocks and pipeline layers (sliding and full layers alternating, each stage building each layer's own mask), its
biased q / k / v / o split over tp as Llama's with its sinks (one learned logit a head) cut with the heads
(`head_vector`), its router and experts whole on every tp rank and routed over ep as the other MoE families'."""
