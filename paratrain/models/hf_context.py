"""Hugging Face models under context parallelism: each rank's part of every sequence.

llama_split_sequence is LLAMA_RECIPE's split_sequence (paratrain.models.hf), gpt2_split_sequence GPT2_RECIPE's: the
positions (Llama's rotary embedding, GPT-2's learned ones) read at the whole sequence's positions of this rank's
tokens (or, for packed documents, their positions in their documents), and attention through transformers'
AttentionInterface to the shard's ring, Ulysses or USP attention, masked to each document when the batch packs
documents.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.nn.documents import Documents
from paratrain.nn.sequence import SequenceSplit
from paratrain.nn.wrap import Wrapper

ATTENTION = "paratrain_context_parallel"
"""The attention implementation (transformers' AttentionInterface) of every HF model under context parallelism:
registered once, with no state; the shard reaches it as a keyword (SHARD_KEY), so no registration keeps a shard, or
its process group, alive after its engine."""

SHARD_KEY = "paratrain_sequence_split"
"""The keyword that carries this rank's SequenceSplit to the attention through transformers' decoder layers."""

DOCUMENTS_KEY = "paratrain_documents"
"""The keyword that carries packed documents' positions ([B, n], this rank's tokens') from paratrain's callers
through transformers' decoder layers (their **kwargs reach the attention function) to the ring or Ulysses
attention: HF's own `position_ids` there cannot tell document positions from the whole sequence's."""


LLAMA_ATTENTIONS = r"model\.layers\.\d+\.self_attn"
LLAMA_ROTARY = r"model\.rotary_emb"
GPT2_ATTENTIONS = r"transformer\.h\.\d+\.attn"


def llama_split_sequence(model: nn.Module, shard: SequenceSplit) -> None:
    """Context parallelism on an HF Llama / Mistral, or a pipeline stage of it (whole-model names).

    Each rank holds `shard`'s part of every sequence, and the model runs on it as on a shorter sequence. Two
    things follow the shard:
      - positions: on a whole model, its base (model.model) is wrapped (WholePositions, same names) so that a
        call without position ids runs at the whole sequence's positions of this rank's tokens, and a call with
        position ids (packed documents: each token's position in its document) runs at those and passes them on
        to attention; on a pipeline stage, model.rotary_emb is wrapped (PositionsOf) to map the runner's local
        positions 0 .. n-1 to the whole sequence's (paratrain.models.hf's runner passes documents' as they are);
      - attention goes through HF's own extension point (transformers' AttentionInterface): one function,
        registered once (ATTENTION), calls the shard it is handed (SHARD_KEY, by the wrappers above) with the
        layer's scaling and the documents' positions if any, and the config's attention implementation names it. No
        attention mask is built for it (HF builds none for a registered function without a mask function):
        causality is by position, documents by their positions.
    Refused, naming the setting: attention dropout (HF draws it from torch's generator, which no rank can
    draw for another's tokens) and a Mistral sliding window shorter than the sequence."""
    _attend_by_shard(model, LLAMA_ATTENTIONS, ("attention_dropout",))
    if _wrap_base(model, "model", shard):
        return
    for rotary_name, rotary in list(model.named_modules()):  # a pipeline stage: its runners call the rotary
        if re.fullmatch(LLAMA_ROTARY, rotary_name):
            parent, _, child = rotary_name.rpartition(".")
            model.get_submodule(parent).register_module(child, PositionsOf(rotary, shard))


def gpt2_split_sequence(model: nn.Module, shard: SequenceSplit) -> None:
    """Context parallelism on an HF GPT-2 (GPT2_RECIPE's split_sequence): as llama_split_sequence on a whole model,
    its base (model.transformer) wrapped so that the learned positions (wpe) are read at the whole sequence's
    positions of this rank's tokens, or at their documents' positions. Refused: dropout (GPT-2 draws it from each
    rank's own generator, so no rank draws a process's mask for its tokens) and a pipeline stage (its embedding
    runner reads positions 0 .. n-1 of the part: not built)."""
    _attend_by_shard(model, GPT2_ATTENTIONS, ("attn_pdrop", "resid_pdrop", "embd_pdrop"))
    if not _wrap_base(model, "transformer", shard):
        raise ConfigError("HF GPT-2 under context parallelism and pipeline parallelism: a stage's embedding reads "
                          "the learned positions of its part of the sequence, not the whole sequence's (not built); "
                          "use pp 1 with cp, or a Llama-family model")


def _attend_by_shard(model: nn.Module, attentions: str, dropouts: tuple[str, ...]) -> None:
    """Route the attention modules matching `attentions` (whole-model names) to the shard's attention through
    transformers' AttentionInterface; refuse the config's non-zero `dropouts`."""
    from transformers import AttentionInterface

    found = [m for n, m in model.named_modules() if re.fullmatch(attentions, n)]
    if not found:
        return
    config = found[0].config
    given = {name: getattr(config, name, 0.0) for name in dropouts if getattr(config, name, 0.0)}
    if given:
        raise ConfigError(f"context parallelism with dropout {given}: HF draws it from torch's generator, which no "
                          f"rank can draw for another rank's tokens; set {', '.join(given)} to 0.0, or cp to 1")
    AttentionInterface.register(ATTENTION, _attend_through)  # the same stateless function each time
    config._attn_implementation = ATTENTION  # the config's setter; every layer reads it when it runs


def _wrap_base(model: nn.Module, base_name: str, shard: SequenceSplit) -> bool:
    """Wrap a whole causal LM's base model (WholePositions); False for a pipeline stage (no whole base model)."""
    from transformers import PreTrainedModel

    base = getattr(model, base_name, None)
    if not isinstance(base, PreTrainedModel):
        return False
    model.register_module(base_name, WholePositions(base, shard))
    return True


class WholePositions(Wrapper):
    """An HF base model (LlamaModel, ...) on this rank's part of each sequence: without position ids it runs at
    the whole sequence's positions of this rank's tokens (HF's default, 0 .. n-1, would be the part's own); with
    position ids (packed documents, this rank's tokens' positions in their documents) it runs at those, and
    hands them to the attention function under DOCUMENTS_KEY so that attention stays inside each document."""

    def __init__(self, module: nn.Module, shard: SequenceSplit) -> None:
        super().__init__(module)
        self.shard = shard

    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        kwargs[SHARD_KEY] = self.shard
        if position_ids is None:
            tokens = input_ids if input_ids is not None else kwargs["inputs_embeds"]
            position_ids = self.shard.positions(tokens.shape[1], tokens.device).unsqueeze(0)  # [1, n]
        else:  # (a Documents under the document-aware split: its positions to HF, the whole of it to attention)
            kwargs[DOCUMENTS_KEY], position_ids = position_ids, Documents.tensor(position_ids)
        return self.wrapped.forward(input_ids, *args, position_ids=position_ids, **kwargs)


class PositionsOf(Wrapper):
    """A pipeline stage's HF rotary embedding fed the whole sequence's positions of this rank's tokens:
    position_ids are the local 0 .. n-1 (as paratrain.models.hf's runner makes them without documents), mapped
    through the shard. `at` takes positions as they are (packed documents': already each token's own)."""

    def __init__(self, module: nn.Module, shard: SequenceSplit) -> None:
        super().__init__(module)
        self.shard = shard

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *rest: Any) -> Any:
        whole = self.shard.positions(position_ids.shape[-1], position_ids.device)[position_ids]
        return self.wrapped.forward(x, whole, *rest)  # rest: Gemma 3's layer type

    def at(self, x: torch.Tensor, position_ids: torch.Tensor, *rest: Any) -> Any:
        return self.wrapped.forward(x, position_ids, *rest)


def _attend_through(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: query [B, H, n, hd], key, value [B, KV, n, hd] (this rank's
    tokens) -> ([B, n, H, hd], no weights). The model's other keywords (sliding_window, softcap, s_aux) are read
    from kwargs to be refused where cp cannot honour them."""
    sliding_window = kwargs.get("sliding_window")
    shard = kwargs.get(SHARD_KEY)
    if shard is None:
        raise ConfigError("an HF model under context parallelism ran without its sequence split: run it whole "
                          "(model(input_ids=...), as paratrain.models.hf.llama_loss does) or through the recipe's "
                          "pipeline layers, which hand the split to attention")
    whole = query.shape[2] * shard.parts
    if kwargs.get("softcap"):
        raise ConfigError(f"context parallelism with attention soft-capping ({kwargs['softcap']}, Gemma 2 / 3): the "
                          "ring and Ulysses attentions compute plain softmax(q k^T) v; set cp to 1")
    if sliding_window is not None and sliding_window < whole:
        raise ConfigError(f"context parallelism attends causally over the whole sequence ({whole} tokens), and this "
                          f"model's sliding window is {sliding_window}: train on sequences of at most "
                          f"{sliding_window} tokens under cp, or set cp to 1")
    if dropout:
        raise ConfigError(f"context parallelism with attention dropout ({dropout}): set attention_dropout=0.0")
    if kwargs.get("s_aux") is not None:
        raise ConfigError("context parallelism with attention sinks (gpt-oss: a learned logit a head beside the "
                          "scores): the ring and Ulysses attentions compute plain softmax(q k^T) v; set cp to 1")
    width = value.shape[-1]
    if width < query.shape[-1]:  # DeepSeek's MLA: v narrower than q / k; zero columns attend to zeros, cut after
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    out = shard.attend(query, key, value, scale=scaling, documents=kwargs.get(DOCUMENTS_KEY))[..., :width]
    return out.transpose(1, 2).contiguous(), None
