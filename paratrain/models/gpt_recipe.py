"""The reference GPT's recipe (paratrain.nn.recipe): its tensor-parallel plan, its blocks, its
pipeline layers and loss, by the module names of paratrain.models.gpt.

    tok_emb | blocks.0 | ... | blocks.{L-1} | head (norm, head, output; mtp, the multi-token prediction depths)

The MTP depths' blocks are blocks like the others (recomputed, ZeRO-3 units, compiled, split by the plan); they run
on the last pipeline stage, which keeps a tied copy of the embedding for them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from paratrain.models.gpt_mtp import MultiTokenLogits
from paratrain.nn.documents import Documents
from paratrain.nn.recipe import Layer, Recipe, Run
from paratrain.nn.sequence import SequenceSplit

GPT_PLAN: dict[str, str] = {
    "tok_emb": "embedding",
    "attn_norm": "norm",  # replicated under 1d, split along the width under 2d
    "mlp_norm": "norm",
    "norm": "norm",
    "attn.qkv": "column",  # output [heads, 3, head_dim]: a column split is a split of the heads
    "attn.core.dropout": "heads_dropout",
    "attn.out": "row",
    "attn.out_dropout": "sequence_dropout",
    "mlp.up": "column",
    "mlp.down": "row",
    "mlp.dropout": "sequence_dropout",
    "head": "column",  # logits stay split along the vocabulary ...
    "output": "vocab_output",  # ... and the loss reads them that way
}
"""The Megatron layout of paratrain.models.GPT: one all-reduce per attention and per MLP, each way."""

_BLOCK = r"(blocks\.\d+|mtp\.depths\.\d+\.block)"

GPT_BLOCKS = _BLOCK
"""The GPT's blocks: "blocks.0", "blocks.1", ..., and each MTP depth's "mtp.depths.{k}.block"."""

GPT_ATTENTION_CORES = _BLOCK + r"\.attn\.core"
"""Each block's attention core (softmax(q k^T) v, no parameters): what selective recompute recomputes."""


GPT_ALONG_SEQUENCE = _BLOCK + r"\.(attn|moe)|mtp"
"""What looks along the sequence: each attention (rotary positions, the core), MoE layer (per-sequence
capacity and load balancing) and the MTP depths (their inputs and labels, tokens ahead)."""

GPT_SEQUENCE_DROPOUTS = _BLOCK + r"\.(attn\.out_dropout|mlp\.dropout|moe\.shared\.dropout)"
"""KeyedDropout over [B, S, D]: their masks are drawn at the tokens' positions in the sequence."""


def gpt_split_sequence(model: nn.Module, shard: SequenceSplit) -> None:
    """Context parallelism on the GPT, or on a pipeline stage of it (whole-model names): every attention
    and MoE layer follows `shard` (their split_sequence), and every [B, S, D] dropout draws its mask at
    this rank's positions."""
    for name, module in model.named_modules():
        if re.fullmatch(GPT_ALONG_SEQUENCE, name):
            module.split_sequence(shard)
        elif re.fullmatch(GPT_SEQUENCE_DROPOUTS, name):
            module.place_along(1, shard.positions, shard.parts)


def gpt_layers(model: nn.Module) -> list[Layer]:
    """The GPT as pipeline layers; each block reads the rotary tables, which travel with it."""
    config = model.config
    d, f, v, s = config.d_model, config.ff_dim, config.padded_vocab, config.seq_len
    block_flops = 2 * (4 * d * d + 2 * d * f) + 4 * s * d  # matmuls + attention scores, per token
    rope = {"rope_cos": model.rope_cos, "rope_sin": model.rope_sin}
    layers = [Layer("tok_emb", {"tok_emb": model.tok_emb}, lambda st, x, *_: st.tok_emb(x), 2.0 * d, positions=True)]
    for i, block in enumerate(model.blocks):
        layers.append(Layer(f"blocks.{i}", {f"blocks.{i}": block}, _block_runner(i), float(block_flops), rope,
                            positions=True))
    head = {"norm": model.norm, "head": model.head, "output": model.output}
    if model.mtp is None:
        layers.append(Layer("head", head, lambda st, x, *_: st.head(st.norm(x)), 2.0 * d * v, positions=True))
    else:  # the MTP depths after the head, on the same (last) stage: they read its hidden input and the tokens
        depths = config.mtp_depth * (block_flops + 2 * (2 * d * d + d * v))
        layers.append(Layer("head", {**head, "mtp": model.mtp}, _head_with_mtp, 2.0 * d * v + depths, rope,
                            positions=True, tokens=True))
    return layers


def _head_with_mtp(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None, *,
                   tokens: torch.Tensor) -> torch.Tensor | MultiTokenLogits:
    logits = stage.head(stage.norm(x))
    if not stage.training:
        return logits
    return MultiTokenLogits(logits, *stage.mtp(x, tokens, Documents.of(positions), stage.rope_cos, stage.rope_sin,
                                               stage.head))


def _block_runner(i: int) -> Run:
    def run(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return stage.blocks[str(i)](x, stage.rope_cos, stage.rope_sin, positions)

    return run


def gpt_stage_loss(stage: nn.Module, logits: torch.Tensor | MultiTokenLogits,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's loss: its `output` module on the head's logits (the GPT's VocabOutput, by row
    chunks over the real vocabulary; under tp the vocab-parallel output the plan put in its place), with the MTP
    depths' losses when the stage ran them."""
    if isinstance(logits, MultiTokenLogits):
        return stage.get_submodule("mtp").loss(stage.get_submodule("output"), logits, targets)
    return stage.get_submodule("output").loss(logits, targets)


GPT_RECIPE = Recipe(tp_plan=GPT_PLAN, blocks=GPT_BLOCKS, attention_cores=GPT_ATTENTION_CORES, layers=gpt_layers,
                    stage_loss=gpt_stage_loss, hidden_size=lambda model: model.config.d_model,
                    split_sequence=gpt_split_sequence)
"""paratrain.models.GPT's recipe (GPT.recipe() returns it)."""
