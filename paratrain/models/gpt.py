"""The reference decoder-only transformer: a plain single-device nn.Module.

No parallel code lives here. Strategies are applied from outside by module name, so the names are
part of the contract:

    tok_emb                      Embedding[Vp, D]   (Vp: vocab_size padded, ModelConfig.padded_vocab)
    blocks.{i}.attn_norm         RMSNorm[D]
    blocks.{i}.attn.qkv          Linear D -> 3D, output laid out as [heads, 3 (q|k|v), head_dim]
    blocks.{i}.attn.core         AttentionCore: softmax(q k^T / sqrt(hd) + causal) v, no parameters
                                 (what selective recomputation recomputes)
    blocks.{i}.attn.core.dropout KeyedDropout on the attention probabilities [B, H, S, S]
    blocks.{i}.attn.out          Linear D -> D
    blocks.{i}.attn.out_dropout  KeyedDropout [B, S, D]
    blocks.{i}.mlp_norm          RMSNorm[D]
    blocks.{i}.mlp.up            Linear D -> F
    blocks.{i}.mlp.down          Linear F -> D
    blocks.{i}.mlp.dropout       KeyedDropout [B, S, D]
    blocks.{i}.moe               MoE instead of mlp in the blocks ModelConfig.is_moe names (router,
                                 experts.up [E, F, D], experts.down [E, D, F], shared: paratrain.nn.moe)
    norm                         RMSNorm[D]
    head                         Linear D -> Vp (its weight is tok_emb's when tied)
    output                       VocabOutput: the loss over the real vocabulary (models/loss.py,
                                 by row chunks), and full logits
    mtp                          multi-token prediction's depths, with mtp_depth > 0 (paratrain.models.gpt_mtp)

The qkv output is interleaved per head so that any contiguous slice of whole heads holds their
q, k and v together: a column split of qkv is then a split of the heads. Attention infers its
local head count from the qkv width and the sequence length from its output, so a narrower
(sharded) qkv, or one that gathers a sequence-split input, needs no change here. Logits leave the
model through `output`, so a strategy that splits the vocabulary replaces that one module.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config.model import ModelConfig
from paratrain.models.gpt_mtp import MTPDepth, MultiTokenLogits, MultiTokenPrediction
from paratrain.models.gpt_recipe import GPT_PLAN, GPT_RECIPE
from paratrain.models.init import Constant, Given, KeyedNormal, ParamInit, init_tensor_
from paratrain.models.norms import RMSNorm, apply_rope, rope_tables, upcast
from paratrain.nn.documents import Documents, refuse_documents
from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.loss import VocabOutput
from paratrain.nn.moe import MoE, RouterLog
from paratrain.nn.router import RouterSettings
from paratrain.nn.recipe import Recipe
from paratrain.nn.sequence import SequenceSplit


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hd) + causal mask) v for q, k, v [B, H, S, hd] -> [B, H, S, hd].

    Without dropout: torch's fused kernel (scaled_dot_product_attention), which saves O(S) per
    head. With dropout: written out, so that the mask is keyed by (row, head, query, key), and it
    saves the [B, H, S, S] scores, probabilities and mask: the 5·a·s/h term of Korthikanti et al.
    2022, which selective recomputation (this module alone) removes.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.p = dropout
        self.dropout = KeyedDropout(dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """documents: packed documents (paratrain.nn.documents), each token attending within its own."""
        if not (self.training and self.p > 0):
            mask = None if documents is None else documents.mask(q.dtype)  # [B, 1, S, S], one for every layer
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        seq = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        allowed = (torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril() if documents is None
                   else documents.mask(torch.bool))
        probs = torch.softmax(upcast(scores.masked_fill(~allowed, float("-inf"))), dim=-1).type_as(q)
        return self.dropout(probs) @ v


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.core = AttentionCore(config.dropout)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.out_dropout = KeyedDropout(config.dropout)
        self.sequence: SequenceSplit | None = None
        """Context parallelism: where this rank's tokens sit in each sequence (split_sequence)."""

    def split_sequence(self, shard: SequenceSplit) -> None:
        """Run on a part of each sequence (context parallelism): q and k are rotated by their tokens'
        positions in the whole sequence, and the core attends through `shard` to the other parts (keeping
        its dropout, keyed by position)."""
        self.sequence = shard
        assert isinstance(self.core, AttentionCore)
        self.core = shard.attention_core(self.core.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """x [B, S, D]; cos, sin the rotary tables of the whole sequence ([seq_len, hd / 2]): row p is
        position p. positions: packed documents (positions[B, S], or the forward's shared Documents), each token
        at its position in its own document and attending within it (paratrain.nn.documents); None: one
        sequence, positions 0 .. S-1."""
        documents = Documents.of(positions)
        # x[B, S, D] @ Wqkv[D, 3D] -> [B, S, H, 3, hd] -> q, k, v each [B, H, S, hd]
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]
        qkv = qkv.view(batch, seq, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        if documents is not None:  # packed documents: each token's position in its own (cp: this rank's tokens')
            cos, sin = cos[documents.positions].unsqueeze(1), sin[documents.positions].unsqueeze(1)  # [B, 1, S, hd/2]
        elif self.sequence is None:  # positions 0 .. S-1
            cos, sin = cos[:seq], sin[:seq]
        else:  # this rank's part of the sequence: its tokens' own positions
            mine = self.sequence.positions(seq, x.device)
            cos, sin = cos[mine], sin[mine]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)  # [B, H, S, hd]
        y = y.transpose(1, 2).reshape(batch, seq, -1)  # [B, S, H * hd]
        return self.out_dropout(self.out(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.ff_dim, bias=False)
        self.down = nn.Linear(config.ff_dim, config.d_model, bias=False)
        self.dropout = KeyedDropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, *, moe: bool = False) -> None:
        """moe: a Mixture-of-Experts layer (`moe`, paratrain.nn.moe) instead of the MLP (`mlp`)."""
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.has_moe = moe
        if moe:
            self.moe = MoE(config.d_model, n_experts=config.n_experts, d_ff=config.expert_dim,
                           router=RouterSettings.of(config), shared=MLP(config) if config.shared_expert else None)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor | Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions)
        return x + (self.moe if self.has_moe else self.mlp)(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, *, init_seed: int = 0) -> None:
        """init_seed: what param_inits() keys the weights by (build_gpt passes its seed)."""
        super().__init__()
        config.validate()
        self.config = config
        self.init_seed = init_seed
        self.tok_emb = nn.Embedding(config.padded_vocab, config.d_model)
        self.blocks = nn.ModuleList(Block(config, moe=config.is_moe(i)) for i in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.head = nn.Linear(config.d_model, config.padded_vocab, bias=False)
        self.output = VocabOutput(config.vocab_size)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.mtp = (MultiTokenPrediction(self.tok_emb, [MTPDepth(config.d_model, config.norm_eps, Block(config))
                                                        for _ in range(config.mtp_depth)], config.mtp_weight)
                    if config.mtp_depth else None)
        self.router_log = RouterLog()
        """The auxiliary losses and expert counts of the MoE layers, when the model runs without an engine
        (the loss sum lacks router_log.aux_sum; their gradient is in the backward already)."""
        for name, module in self.named_modules():
            if isinstance(module, MoE):
                module.attach(self.router_log, name)
        cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor | MultiTokenLogits:
        """idx[B, S] (token ids) -> logits[B, S, Vp] (padded vocabulary; `output` reads them); in training with MTP
        depths MultiTokenLogits (lm_loss takes either). positions[B, S]: packed documents (paratrain.nn.documents):
        each token at its position in its own document, attending only within it; None: one sequence per row."""
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq_len {self.config.seq_len}")
        x = self.tok_emb(idx)
        documents = Documents.of(positions)  # one mask for every layer
        for block in self.blocks:  # each attention takes the rows of the rotary tables its tokens are at
            x = block(x, self.rope_cos, self.rope_sin, documents)
        logits = self.head(self.norm(x))
        if self.mtp is None or not self.training:
            return logits
        return MultiTokenLogits(logits, *self.mtp(x, idx, documents, self.rope_cos, self.rope_sin, self.head))

    def split_sequence(self, shard: SequenceSplit) -> None:
        """Run on a part of each sequence (context parallelism; the recipe's split_sequence)."""
        GPT_RECIPE.split_sequence(self, shard)  # type: ignore[misc]

    def recipe(self) -> Recipe:
        """What the strategies need to know about the GPT (paratrain.models.gpt_recipe): its tensor-parallel
        plan (without the dense MLP's entries when every block has a MoE layer), its blocks, its pipeline layers
        and loss."""
        if self.config.n_experts and all(self.config.is_moe(i) for i in range(self.config.n_layer)):
            plan = {k: v for k, v in GPT_PLAN.items() if not k.startswith("mlp.")}  # (the MTP depths' blocks: dense)
            depths = {f"mtp.depths.*.block.{k}": v for k, v in GPT_PLAN.items() if k.startswith("mlp.")}
            return GPT_RECIPE.with_overrides(tp_plan={**plan, **(depths if self.config.mtp_depth else {})})
        return GPT_RECIPE

    def param_inits(self, seed: int | None = None) -> dict[str, ParamInit]:
        """How to initialise every tensor, by name (each stored tensor once; non-persistent buffers too),
        keyed by `seed` (None: init_seed), layout-free (paratrain.models.init): GPT-2's N(0, 0.02),
        residual output projections scaled by 1/sqrt(2 * n_layer) (Radford et al. 2019, section 2.3),
        norms at 1. parallelize reads this to materialise only a rank's pieces of a model built on the
        meta device."""
        seed = self.init_seed if seed is None else seed
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        inits: dict[str, ParamInit] = {}
        for name, _ in self.named_parameters():
            if name.endswith("norm.weight"):
                inits[name] = Constant(1.0)
            elif name.endswith(("attn.out.weight", "mlp.down.weight", "moe.experts.down", "shared.down.weight")):
                inits[name] = KeyedNormal(seed, name, residual_std)
            else:
                inits[name] = KeyedNormal(seed, name, 0.02)
        for name, _ in self.named_buffers():
            if name.endswith("router.expert_bias"):  # the balancing bias starts at 0
                inits[name] = Constant(0.0)
        cos, sin = rope_tables(self.config.seq_len, self.config.head_dim, self.config.rope_theta)
        inits["rope_cos"], inits["rope_sin"] = Given(cos), Given(sin)
        return inits

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from param_inits(seed), on the model's device (not on the meta device:
        parallelize materialises such a model piece by piece)."""
        inits = self.param_inits(seed)
        for name, param in self.named_parameters():
            init_tensor_(param, inits[name])

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.8,
                 top_k: int = 40, generator: torch.Generator | None = None, pad_to: int = 1) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx[B, S] (top-k sampling).

        pad_to: run each forward on a length rounded up to a multiple of this, padding on the right
        (causal attention: the real positions never see the padding), for strategies that split the
        sequence into equal parts."""
        for _ in range(max_new_tokens):
            context = idx[:, -(self.config.seq_len - self.config.seq_len % pad_to):]
            length = context.shape[1]
            padded = -(-length // pad_to) * pad_to
            if padded != length:
                context = torch.cat((context, context.new_zeros(context.shape[0], padded - length)), dim=1)
            out = self(context)  # training with MTP depths: MultiTokenLogits, whose .main are the next-token logits
            logits = upcast(self.output.full(getattr(out, "main", out))[:, length - 1, :]) / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat((idx, next_token), dim=1)
        return idx


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy as (sum over tokens, number of tokens), the shape the engine wants.
    batch: (inputs, targets), or (inputs, targets, positions) for packed documents (paratrain.nn.documents).

    The engine divides by the token count of the whole global batch, so that the loss does not
    depend on how the batch was split into ranks and micro-batches.
    """
    inputs, targets, *positions = batch
    if positions:  # a layout that cannot take them says so (paratrain.nn.documents)
        refuse_documents(model)
    logits = model(inputs, *positions)
    output = getattr(model, "output", None)
    if isinstance(logits, MultiTokenLogits):  # the GPT's MTP depths, in training
        return model.mtp.loss(output, logits, targets)
    if hasattr(output, "loss"):
        return output.loss(logits, targets)  # type: ignore[union-attr]
    return VocabOutput(logits.shape[-1]).loss(logits, targets)


def build_gpt(config: ModelConfig, *, seed: int, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> GPT:
    """A GPT with layout-free weights, on `device` in `dtype`. device "meta": shapes only, nothing
    allocated or initialised; parallelize then materialises each rank's pieces from param_inits(seed)
    (the same numbers as a full build, bit for bit)."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return GPT(config, init_seed=seed).to(dtype=dtype)
    model = GPT(config, init_seed=seed)
    model.init_weights(seed)
    return model.to(device=device, dtype=dtype)

