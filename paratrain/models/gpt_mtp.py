"""Multi-token prediction for the reference GPT (DeepSeek-V3, Liu et al. 2024, section 2.2): after the last block, D
more depths, depth k predicting the token k + 1 places ahead of each position.

    h^0            the last block's output (before the final norm)
    depth k        h^k = Block_k(proj_k([hidden_norm_k(h^{k-1}); embed_norm_k(E(t_{i+k}))]))
                   logits^k = head(norm_k(h^k)), against t_{i+k+1}
    loss           ( sum_i CE(logits_i, t_{i+1}) + mtp_weight / D * sum_k sum_i CE(logits^k_i, t_{i+k+1}) ) / N

E and head are the model's own (one Parameter each, shared: `mtp.tok_emb.weight` is `tok_emb.weight`, so a pipeline
keeps a tied copy on its last stage), N the next-token loss's token count (the engine's, over the global batch), so
the sum is the same in every layout; DeepSeek-V3 divides each depth by its own count instead, a few tokens fewer. A
position whose token k places ahead lies past the sequence's end or in another packed document takes no depth-k loss
(its label is -100). The depths run in training only: eval, generation and the reported validation loss are the
next-token model's.

Names (the contract strategies read, as in gpt.py):

    mtp.tok_emb                     the model's tok_emb (tied; the tensor-parallel plan's "tok_emb" entry splits it)
    mtp.depths.{k}.hidden_norm      RMSNorm[D] of h^{k-1}
    mtp.depths.{k}.embed_norm       RMSNorm[D] of the embedding of the tokens k + 1 ahead of the inputs
    mtp.depths.{k}.proj             Linear 2D -> D (replicated under tp; summed over tp under sequence parallelism)
    mtp.depths.{k}.block            a dense Block (the GPT's plan entries split it as the others)
    mtp.depths.{k}.norm             RMSNorm[D] before the shared head

Context parallelism shifts the inputs and labels on the whole sequence (paratrain.nn.sequence.look_ahead gathers the
token ids over cp), so the token k ahead of a rank's last position comes from the rank holding it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from paratrain.models.norms import RMSNorm
from paratrain.nn.documents import Documents
from paratrain.nn.sequence import SequenceSplit, look_ahead

IGNORE = -100
"""The label that takes no loss (the output modules' ignore_index)."""


class MultiTokenLogits(NamedTuple):
    """What a GPT with MTP depths returns in training: the next-token logits and each depth's."""

    main: torch.Tensor
    """[B, n, Vp]: the next-token logits."""
    ahead: tuple[torch.Tensor, ...]
    """Depth k's logits [B, n, Vp] (k = 1 .. D): for the token k + 1 places ahead."""
    keep: tuple[torch.Tensor, ...]
    """bool [B, n] per depth: the token k places ahead is in the sequence and in the same document."""


class MTPDepth(nn.Module):
    def __init__(self, d_model: int, eps: float, block: nn.Module) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(d_model, eps)
        self.embed_norm = RMSNorm(d_model, eps)
        self.proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = RMSNorm(d_model, eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None) -> torch.Tensor:
        x = self.proj(torch.cat((self.hidden_norm(hidden), self.embed_norm(embedded)), dim=-1))
        # the depth's residual stream in the trunk's dtype (float32 under autocast, as the embedding starts it)
        return self.block(x.to(hidden.dtype), cos, sin, documents)


class MultiTokenPrediction(nn.Module):
    def __init__(self, tok_emb: nn.Embedding, depths: list[MTPDepth], weight: float) -> None:
        """tok_emb: the model's embedding (its weight is shared, not copied); depths: one MTPDepth each."""
        super().__init__()
        self.tok_emb = nn.Embedding(tok_emb.num_embeddings, tok_emb.embedding_dim, device="meta")
        self.tok_emb.weight = tok_emb.weight
        self.depths = nn.ModuleList(depths)
        self.weight = weight
        self.sequence: SequenceSplit | None = None
        """Context parallelism: where this rank's tokens sit in each sequence (split_sequence)."""

    def split_sequence(self, shard: SequenceSplit) -> None:
        """Run on a part of each sequence: inputs and labels are shifted on the whole sequence (look_ahead)."""
        self.sequence = shard

    reads_fixed_split = "multi-token prediction shifts its inputs and labels in the fixed split's order"
    """Why MTP cannot follow a split that changes by micro-batch (paratrain.hybrid.steps.apply_context_parallel)."""

    def forward(self, hidden: torch.Tensor, idx: torch.Tensor, documents: Documents | None, cos: torch.Tensor,
                sin: torch.Tensor, head: nn.Module) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """hidden: the last block's output; idx[B, n] the input token ids; head: the model's (shared). Returns each
        depth's logits and where its token ahead exists (MultiTokenLogits.ahead, .keep)."""
        logits, keeps = [], []
        positions = None if documents is None else documents.positions
        for k, depth in enumerate(self.depths, start=1):
            tokens = look_ahead(idx, k, IGNORE, split=self.sequence, documents=positions)
            keep = tokens != IGNORE
            hidden = depth(hidden, self.tok_emb(torch.where(keep, tokens, 0)), cos, sin, documents)
            logits.append(head(depth.norm(hidden)))
            keeps.append(keep)
        return tuple(logits), tuple(keeps)

    def loss(self, output: nn.Module, logits: MultiTokenLogits,
             targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next-token loss sum plus weight / D times the depths' loss sums, the next-token token count); output:
        the model's `output` module (the vocab-parallel one under tp)."""
        total, count = output.loss(logits.main, targets)
        for k, (ahead, keep) in enumerate(zip(logits.ahead, logits.keep, strict=True), start=1):
            labels = torch.where(keep, look_ahead(targets, k, IGNORE, split=self.sequence), IGNORE)
            depth_sum, _ = output.loss(ahead, labels)
            total = total + (self.weight / len(self.depths)) * depth_sum
        return total, count
