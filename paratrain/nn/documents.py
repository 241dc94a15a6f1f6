"""Documents packed into one sequence: positions that restart at every document, attention that does not
cross from one document into another.

A packed window of S tokens holds the end of one document, whole documents and the start of another. With
document masking each token's position counts from the start of its document (or of the window, for the
document that began before it), and a token attends only to the earlier tokens of its own document. One
tensor says both, positions[B, S] (int64):

    query i may attend to key j  <=>  j <= i  and  i - j <= positions[b, i]

so the mask needs no document ids, and a pipeline stage, a tensor-parallel rank or a sequence-parallel
attention reads it from the same tensor the rotary embedding reads. The loss is not taken where the next
token starts another document (its label is -100: nothing in the window's own document predicts it);
paratrain.data.GlobalBatchLoader(document_starts=...) makes both from a corpus's document index.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from paratrain.config.errors import ConfigError


def refuse_documents(model: nn.Module) -> None:
    """Raise ConfigError if a module of `model` says it cannot take document positions (a `refuses_positions`
    message: Hugging Face rotary embeddings under context parallelism), before a step runs on them."""
    for module in model.modules():
        refusal = getattr(module, "refuses_positions", "")
        if refusal:
            raise ConfigError(refusal)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """positions[B, S] -> bool[B, 1, S, S], True where query i may attend to key j (its own document's
    earlier tokens, itself included): the attn_mask of torch's scaled_dot_product_attention."""
    seq = positions.shape[-1]
    index = torch.arange(seq, device=positions.device)
    back = index[:, None] - index[None, :]  # [S, S]: i - j, how far back key j lies from query i
    return ((back >= 0) & (back <= positions[:, :, None])).unsqueeze(1)


def positions_after(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """positions[B, S] for windows whose documents each end with `eos_id` (what `paratrain tokenize` writes):
    0 at the window's first token and after every end-of-sequence token, counting up in between."""
    seq = input_ids.shape[-1]
    index = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    starts[:, 0] = True
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start


class WindowSplit(NamedTuple):
    """Where a context-parallel rank's tokens sit in the packed window when the split follows the documents
    (paratrain.context_parallel.layout.document_split: it changes with every micro-batch)."""

    mine: torch.Tensor
    """int64 [n] on the device: the window positions of this rank's tokens, in its order."""
    everyone: torch.Tensor
    """int64 [cp, n] on the host: every cp rank's, row r rank r's."""
    starts: tuple[int, ...] | None = None
    """Where the documents start in the window when every row of the micro-batch has the same (a micro-batch of
    one row): the CPU's fused ring kernel then computes only pairs inside documents. None: they differ by row."""


class Documents:
    """One batch's packed documents, positions[B, S], and their attention mask built once per dtype and shared by
    every attention of a forward that is given this object: a kernel keeping its mask for backward then keeps one
    for the whole model, not one per layer. (A pipeline stage's layers are each given the micro-batch's positions
    alone, and build their own.) Under context parallelism with the document-aware split the micro-batch carries
    this object in the positions' place, with `split` saying where its tokens sit in the window."""

    def __init__(self, positions: torch.Tensor, split: WindowSplit | None = None) -> None:
        self.positions = positions
        self.split = split
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def of(given: torch.Tensor | Documents | None) -> Documents | None:
        return given if given is None or isinstance(given, Documents) else Documents(given)

    @property
    def shape(self) -> torch.Size:
        """positions' [B, S] (what a micro-batch's tensors are asked for: rows, sequence)."""
        return self.positions.shape

    @staticmethod
    def tensor(given: torch.Tensor | Documents | None) -> torch.Tensor | None:
        """The positions[B, S] of `given` (a tensor as it is)."""
        return given.positions if isinstance(given, Documents) else given

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, S, S]: bool (True where a query may attend), or additive in a floating dtype (0 there, -inf
        elsewhere: what scaled_dot_product_attention would turn a bool mask into, call by call)."""
        if dtype not in self._masks:
            allowed = document_mask(self.positions)
            self._masks[dtype] = allowed if dtype == torch.bool else torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return self._masks[dtype]
