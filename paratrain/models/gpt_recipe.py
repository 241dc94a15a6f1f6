"""The reference GPT's recipe (paratrain.nn.recipe): its tensor-parallel plan, its blocks, its
pipeline layers and loss, by the module names of paratrain.models.gpt.

    tok_emb | blocks.0 | ... | blocks.{L-1} | head (norm, head, output)
"""

from __future__ import annotations

import re

import torch
from torch import nn

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

GPT_BLOCKS = r"blocks\.\d+"
"""The GPT's blocks: "blocks.0", "blocks.1", ..."""

GPT_ATTENTION_CORES = r"blocks\.\d+\.attn\.core"
"""Each block's attention core (softmax(q k^T) v, no parameters): what selective recompute recomputes."""


GPT_ALONG_SEQUENCE = r"blocks\.\d+\.(attn|moe)"
"""What looks along the sequence: each attention (rotary positions, the core) and MoE layer (per-sequence
capacity and load balancing)."""

GPT_SEQUENCE_DROPOUTS = r"blocks\.\d+\.(attn\.out_dropout|mlp\.dropout|moe\.shared\.dropout)"
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
    layers.append(Layer("head", {"norm": model.norm, "head": model.head, "output": model.output},
                        lambda st, x, *_: st.head(st.norm(x)), 2.0 * d * v, positions=True))
    return layers


def _block_runner(i: int) -> Run:
    def run(stage: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return stage.blocks[str(i)](x, stage.rope_cos, stage.rope_sin, positions)

    return run


def gpt_stage_loss(stage: nn.Module, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's loss: its `output` module on the head's logits (the GPT's VocabOutput, by row
    chunks over the real vocabulary; under tp the vocab-parallel output the plan put in its place)."""
    return stage.get_submodule("output").loss(logits, targets)


GPT_RECIPE = Recipe(tp_plan=GPT_PLAN, blocks=GPT_BLOCKS, attention_cores=GPT_ATTENTION_CORES, layers=gpt_layers,
                    stage_loss=gpt_stage_loss, hidden_size=lambda model: model.config.d_model,
                    split_sequence=gpt_split_sequence)
"""paratrain.models.GPT's recipe (GPT.recipe() returns it)."""
