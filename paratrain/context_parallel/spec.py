"""AttentionSpec: what a context-parallel attention core computes besides its tensors, positions and groups, one object
for ring, Ulysses and USP attention (paratrain.context_parallel.ring, .ulysses, .usp) and the shard that calls them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.nn.dropout import KeyedDropout


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """causal: key position <= query position. scale: of q k^T, 1 / sqrt(D) when None. dropout: a KeyedDropout on the
    attention probabilities, drawn at their (query, key) positions of the whole sequence as one process draws them.
    documents: [B, S_l], each query's position in its packed document (paratrain.nn.documents; causal only).
    document_starts: where the documents start in the window when every row has the same (ring attention's fused
    kernel then computes only pairs inside documents: paratrain.context_parallel.fused). head_block: (index, heads)
    when q's H heads are block `index` of the `heads` the dropout's tensor has (USP's ring)."""

    causal: bool = True
    scale: float | None = None
    dropout: KeyedDropout | None = None
    documents: torch.Tensor | None = None
    document_starts: tuple[int, ...] | None = None
    head_block: tuple[int, int] | None = None

    def scale_of(self, head_dim: int) -> float:
        """The scale of q k^T for heads of `head_dim`: this spec's, else 1 / sqrt(head_dim)."""
        return head_dim ** -0.5 if self.scale is None else self.scale
