"""Hugging Face GPT-2 (transformers' GPT2LMHeadModel) under paratrain: its recipe, by module name.

    transformer.wte                    Embedding[V, D]          (tied to lm_head)
    transformer.wpe                    Embedding[P, D]          learned positions
    transformer.h.{i}.ln_1 / ln_2      LayerNorm[D]
    transformer.h.{i}.attn.c_attn      Conv1D D -> 3D: weight [D, 3D] ([in, out], transposed from nn.Linear),
                                       its output q | k | v, each [H * hd]
    transformer.h.{i}.attn.c_proj      Conv1D D -> D
    transformer.h.{i}.mlp.c_fc         Conv1D D -> F
    transformer.h.{i}.mlp.c_proj       Conv1D F -> D
    transformer.ln_f                   LayerNorm[D]
    lm_head                            Linear D -> V

Tensor parallelism splits c_attn's three blocks alike ("conv1d_qkv": rank r holds q, k and v of its heads,
[q_r | k_r | v_r]), so a checkpoint slice is a slice of each block (paratrain.hybrid.pieces: a cut with
blocks); the attention splits that output by its `split_size`, which gpt2_tp_local makes D / tp. The batch
convention is paratrain.models.hf's (labels aligned to the inputs; packed documents' positions index wpe).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.models.hf import llama_pipeline_loss
from paratrain.models.hf_context import gpt2_split_sequence
from paratrain.nn.recipe import Layer, Recipe, Run, stage_loss

GPT2_TP_PLAN: dict[str, str] = {
    "transformer.wte": "embedding",  # vocab-parallel, as lm_head: the tied pair stays one split tensor
    "attn.c_attn": "conv1d_qkv",  # [D, 3D] -> [D, 3D / tp]: whole heads of q, k and v
    "attn.c_proj": "conv1d_row",
    "mlp.c_fc": "conv1d_column",
    "mlp.c_proj": "conv1d_row",
    "lm_head": "column_gather",
}
"""Megatron's layout of GPT-2: one all-reduce per attention and per MLP each way, and one for the embedding."""

GPT2_WRAP = r"transformer\.h\.\d+"
"""ZeRO-3 units and recompute / compile blocks: each transformer block."""

GPT2_ATTENTIONS = r"(.*\.)?transformer\.h\.\d+\.attn"


def check_gpt2_tp(config: Any, tp: int, *, sequence_parallel: bool = False, pad_vocab: bool = False) -> None:
    """Raise ConfigError unless GPT2_TP_PLAN applies to this GPT-2 config at this tp degree."""
    heads, width = config.n_head, config.n_embd
    inner = config.n_inner or 4 * width
    if heads % tp or inner % tp:
        raise ConfigError(f"tensor parallelism splits GPT-2's attention by whole heads and its MLP along n_inner: "
                          f"n_head ({heads}) and n_inner ({inner}) must be divisible by tp ({tp})")
    if config.vocab_size % tp and not pad_vocab:
        raise ConfigError(f"transformer.wte and lm_head split along vocab_size ({config.vocab_size}), which must be "
                          f"divisible by tp ({tp}): load with paratrain.hf.from_pretrained(folder, pad_vocab_to={tp})")
    if sequence_parallel:
        raise ConfigError("sequence parallelism does not apply to HF GPT-2 (its attention reshapes with the input's "
                          "sequence length); set sequence_parallel=False")
    dropouts = {k: getattr(config, k, 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if tp > 1 and any(dropouts.values()):
        raise ConfigError(f"GPT-2's dropout {dropouts} under tp {tp}: transformers draws it from each rank's own "
                          "generator, so the activations tp keeps equal on every rank would differ (silently wrong "
                          "training); set resid_pdrop, embd_pdrop and attn_pdrop to 0 in config.json, or tp 1")
    if getattr(config, "add_cross_attention", False):
        raise ConfigError("a GPT-2 with add_cross_attention (an encoder-decoder's decoder) has no recipe: paratrain "
                          "trains GPT-2 as a causal language model; set add_cross_attention false")


def gpt2_tp_local(model: nn.Module, tp: int) -> None:
    """Each attention splits its c_attn output ([q_r | k_r | v_r] when the plan split it) into its three
    thirds: the width c_attn now has, whatever the plan did to it."""
    for name, module in model.named_modules():
        if re.fullmatch(GPT2_ATTENTIONS, name):
            module.split_size = module.c_attn.weight.shape[1] // 3


def gpt2_layers(model: nn.Module) -> list[Layer]:
    """GPT-2 as pipeline layers: wte + wpe | transformer.h.0 | ... | ln_f + lm_head; each block runs as
    GPT2Model.forward runs it without cache (positions 0 .. S-1 or the micro-batch's packed documents')."""
    config, base = model.config, model.transformer
    d, v = config.n_embd, config.vocab_size
    embed = {"transformer.wte": base.wte, "transformer.wpe": base.wpe, "transformer.drop": base.drop}
    layers = [Layer("transformer.wte", embed, _embed, 2.0 * d, positions=True)]
    for i, block in enumerate(base.h):
        name = f"transformer.h.{i}"
        matmuls = sum(p.numel() for p in block.parameters() if p.dim() == 2)
        layers.append(Layer(name, {name: block}, _block_runner(name, config), 2.0 * matmuls, positions=True))
    layers.append(Layer("lm_head", {"transformer.ln_f": base.ln_f, "lm_head": model.lm_head}, _head, 2.0 * d * v,
                        positions=True))
    return layers


def _positions(x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0) if positions is None else positions


def _embed(stage: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    x = stage.get_submodule("transformer.wte")(input_ids)
    x = x + stage.get_submodule("transformer.wpe")(_positions(input_ids, positions))
    return stage.get_submodule("transformer.drop")(x)


def _head(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    return stage.get_submodule("lm_head")(stage.get_submodule("transformer.ln_f")(x))


def _block_runner(name: str, config: Any) -> Run:
    def run(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = _positions(x, positions)
        mask = create_causal_mask(config, x, None, None, position_ids=position_ids)  # per document when packed
        return stage.get_submodule(name)(x, None, mask, position_ids=position_ids)

    return run


GPT2_RECIPE = Recipe(tp_plan=GPT2_TP_PLAN, blocks=GPT2_WRAP, layers=gpt2_layers,
                     stage_loss=stage_loss(llama_pipeline_loss), hidden_size=lambda model: model.config.n_embd,
                     tp_local=gpt2_tp_local, split_sequence=gpt2_split_sequence)
"""HF GPT-2's recipe (context parallelism on the whole model: paratrain.models.hf_context)."""
