"""Shape of the reference decoder-only transformer, and its named presets.

The model code (paratrain.models.gpt) reads this; the validator and, later, the planner read it too,
which is why it lives in config/ rather than next to the module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

from paratrain.config.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the GPT. All presets use dropout 0, as modern pretraining does."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256: byte-level, the built-in corpus)."""
    vocab_multiple: int = 1
    """The embedding and head have vocab_size rounded up to a multiple of this many rows
    (padded_vocab); the padding rows are never targets and are left out of the softmax. Tensor
    parallelism splits the padded vocabulary, so tp must divide padded_vocab; the rule does not
    depend on tp, so every layout trains the same model."""
    seq_len: int = 128
    """Longest sequence the model is built for (RoPE tables are this long)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; d_model must divide into them evenly."""
    d_model: int = 128
    """Width of the residual stream."""
    d_ff: int = 0
    """Hidden width of the MLP; 0 means 4 * d_model."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout on attention output and MLP output. Layout invariance is promised at 0."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    n_experts: int = 0
    """Mixture-of-Experts (paratrain.nn.moe): experts per MoE layer; 0: every MLP dense."""
    top_k: int = 1
    """Experts each token is routed to (1: Switch, 2: GShard / Mixtral, 8: DeepSeek-V3 / Qwen3-MoE; at most 8)."""
    router: str = "softmax"
    """Router scores: 'softmax' over the experts, or 'sigmoid' per expert (DeepSeek-V3; the chosen weights are
    renormalised to sum to 1)."""
    expert_groups: int = 1
    """Groups of experts (DeepSeek's n_group): a token chooses among the experts of its topk_groups best groups only
    (a group scored by its two best experts). 1: no group limit."""
    topk_groups: int = 1
    """Groups a token's experts may come from (DeepSeek's topk_group), with expert_groups > 1."""
    router_scale: float = 1.0
    """The chosen experts' weights times this (DeepSeek's routed_scaling_factor, 2.5 in V3)."""
    expert_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing only, moved by
    this much each step towards balance from the global batch's counts (0.001 in V3); 0: off."""
    moe_every: int = 1
    """Block i has a MoE layer instead of its MLP when (i + 1) % moe_every == 0 (2: every other block)."""
    d_expert: int = 0
    """Hidden width of each expert; 0: ff_dim."""
    shared_expert: bool = False
    """A dense MLP (width ff_dim) beside the experts in every MoE layer, on every token."""
    capacity_factor: float = 0.0
    """Assignments an expert takes from one sequence: ceil(this x seq x top_k / n_experts); the rest
    are dropped (the token keeps its residual). 0: dropless."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (per sequence, averaged over sequences)."""
    global_aux_coef: float = 0.0
    """Weight of the global-batch load-balancing loss (Qiu et al. 2025, "Demons in the Detail"): E sum_e f_e P_e with
    f_e the fraction of the previous step's global batch's assignments expert e ran (the last whole batch whose
    counts every layout knows alike: the current one's are not known before a micro-batch's backward) and P_e the
    mean router probability over the tokens; 0: off."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (per token, averaged over tokens)."""
    mtp_depth: int = 0
    """Multi-token prediction (DeepSeek-V3, paratrain.models.gpt_mtp): D extra depths after the last block, depth k
    predicting the token k + 1 places ahead through its own block, the embedding and head shared; 0: off."""
    mtp_weight: float = 0.3
    """The MTP losses' weight (DeepSeek-V3's lambda: 0.3, then 0.1): the loss is the next-token loss plus
    mtp_weight / mtp_depth times the depths' summed losses, all over the next-token loss's token count."""

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def padded_vocab(self) -> int:
        """vocab_size rounded up to a multiple of vocab_multiple (50257 -> 50304 at 128)."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def expert_dim(self) -> int:
        return self.d_expert or self.ff_dim

    def is_moe(self, block: int) -> bool:
        """Whether block `block` (0-based) has a MoE layer instead of its MLP."""
        return self.n_experts > 0 and (block + 1) % self.moe_every == 0

    @functools.cached_property
    def moe_layers(self) -> int:
        """Blocks with a MoE layer (counted once: the planner's search reads it for every candidate)."""
        return sum(self.is_moe(i) for i in range(self.n_layer))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def validate(self) -> None:
        positive = ("vocab_size", "vocab_multiple", "seq_len", "n_layer", "n_head", "d_model")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and h <= 64]
            raise ConfigError(
                f"model.n_head ({self.n_head}) must divide model.d_model ({self.d_model}): "
                f"choose n_head in {divisors} or change d_model"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = d_model / n_head = {self.d_model} / {self.n_head} = {self.head_dim} must be "
                "even for rotary embeddings: change d_model or n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.d_ff < 0:
            raise ConfigError(f"model.d_ff must be >= 0 (0: 4 x d_model), got {self.d_ff}")
        if self.n_experts < 0 or self.n_experts == 1:
            raise ConfigError(f"model.n_experts must be 0 (dense) or >= 2, got {self.n_experts}")
        if self.n_experts:
            if not 1 <= self.top_k <= min(8, self.n_experts):
                raise ConfigError(f"model.top_k must be in 1 .. {min(8, self.n_experts)} (at most 8, and at most "
                                  f"n_experts = {self.n_experts}), got {self.top_k}")
            self._check_router()
            if self.moe_every < 1 or self.moe_every > self.n_layer:
                raise ConfigError(f"model.moe_every must be in 1 .. n_layer ({self.n_layer}), got {self.moe_every}: "
                                  "block i has a MoE layer when (i + 1) % moe_every == 0")
            if self.d_expert < 0:
                raise ConfigError(f"model.d_expert must be >= 0 (0: ff_dim), got {self.d_expert}")
            for name in ("capacity_factor", "aux_loss_coef", "global_aux_coef", "z_loss_coef"):
                value = getattr(self, name)
                if not (math.isfinite(value) and value >= 0):
                    raise ConfigError(f"model.{name} must be a finite number >= 0, got {value}")
            if 0 < self.capacity_factor * self.seq_len * self.top_k < self.n_experts:
                raise ConfigError(
                    f"model.capacity_factor {self.capacity_factor:g}: ceil({self.capacity_factor:g} x seq_len "
                    f"{self.seq_len} x top_k {self.top_k} / n_experts {self.n_experts}) gives every expert a single "
                    "slot at most; use a capacity_factor of at least 1, or 0 (dropless)")
        if not 0 <= self.mtp_depth < self.seq_len:
            raise ConfigError(f"model.mtp_depth must be in 0 .. seq_len - 1 ({self.seq_len - 1}) (--mtp-depth; 0: off), "
                              f"got {self.mtp_depth}")
        if not (math.isfinite(self.mtp_weight) and self.mtp_weight >= 0):
            raise ConfigError(f"model.mtp_weight must be a finite number >= 0 (--mtp-weight), got {self.mtp_weight}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"model.{name} must be a finite number > 0, got {value}")

    def _check_router(self) -> None:
        if self.router not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.router must be 'softmax' or 'sigmoid' (--router), got {self.router!r}")
        groups, chosen = self.expert_groups, self.topk_groups
        if groups < 1 or self.n_experts % groups:
            raise ConfigError(f"model.expert_groups ({groups}) must divide n_experts ({self.n_experts}) "
                              "(--expert-groups; 1: no group limit)")
        if not 1 <= chosen <= groups:
            raise ConfigError(f"model.topk_groups ({chosen}) must be in 1 .. expert_groups ({groups}) (--topk-groups)")
        if groups > 1 and chosen * (self.n_experts // groups) < self.top_k:
            raise ConfigError(f"top_k {self.top_k} experts from topk_groups {chosen} groups of "
                              f"{self.n_experts // groups} experts: the groups kept hold {chosen * self.n_experts // groups}"
                              " experts; raise --topk-groups or lower --top-k")
        for name in ("router_scale", "expert_bias_rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= (0 if name == "expert_bias_rate" else 1e-12)):
                raise ConfigError(f"model.{name} must be a finite number {'>= 0' if 'bias' in name else '> 0'}, "
                                  f"got {value}")

    def num_params(self) -> int:
        """Parameter count (tied head counted once; every expert), from the shapes alone."""
        d, f, v = self.d_model, self.ff_dim, self.padded_vocab
        head = 0 if self.tie_embeddings else v * d
        moe = self.moe_layers * (self.moe_layer_params(self.n_experts) - 2 * d * f)  # a MoE layer instead of an MLP
        return v * d + self.n_layer * self.dense_block_params + d + head + moe + self.mtp_depth * self.mtp_depth_params

    @property
    def dense_block_params(self) -> int:
        """One block with a dense MLP: qkv, out, up, down, two norms."""
        d, f = self.d_model, self.ff_dim
        return 3 * d * d + d * d + d * f + f * d + 2 * d

    @property
    def mtp_depth_params(self) -> int:
        """One MTP depth: its two input norms, the projection of [h; e] (2D -> D), a dense block and its output norm
        (the embedding and head are the model's)."""
        d = self.d_model
        return 2 * d + 2 * d * d + self.dense_block_params + d

    def moe_layer_params(self, experts: int) -> int:
        """Parameters of one MoE layer counting `experts` experts (router, experts, shared expert)."""
        d = self.d_model
        return d * self.n_experts + experts * 2 * d * self.expert_dim + (2 * d * self.ff_dim if self.shared_expert else 0)

    def active_params(self) -> int:
        """Parameters a token runs through: top_k experts of each MoE layer (num_params when dense)."""
        if not self.n_experts:
            return self.num_params()
        return self.num_params() - self.moe_layers * (self.moe_layer_params(self.n_experts) - self.moe_layer_params(self.top_k))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12 * L * d * S for attention scores
        (PaLM, Chowdhery et al. 2022, appendix B). N excludes the embedding lookup; with experts, N counts
        the top_k experts a token runs through (active_params)."""
        s = seq_len or self.seq_len
        n = self.active_params() - self.padded_vocab * self.d_model
        if self.tie_embeddings:  # the tied head is still a matmul
            n += self.padded_vocab * self.d_model
        # each MTP depth runs its block (in N already), attention, and the shared head once more
        mtp = self.mtp_depth * (6.0 * self.padded_vocab * self.d_model + 12.0 * self.d_model * s)
        return 6.0 * n + 12.0 * self.n_layer * self.d_model * s + mtp


# GPT-2: Radford et al. 2019 (vocabulary padded 50257 -> 50304, a multiple of 128, so that tp up to
# 128 divides it and the head's matmul has friendly shapes).  GPT-3: Brown et al. 2020, table 2.1 (13B's d_model is printed as
# 5140, which 40 heads do not divide; 40 x 128 = 5120 is what the head size implies).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64),
    "small": ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),
    "gpt2": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt2-medium": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
    "gpt2-large": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=1024, n_layer=36, n_head=20, d_model=1280),
    "gpt2-xl": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=1024, n_layer=48, n_head=25, d_model=1600),
    "gpt3-small": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=12, n_head=12, d_model=768),
    "gpt3-medium": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=24, n_head=16, d_model=1024),
    "gpt3-large": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=24, n_head=16, d_model=1536),
    "gpt3-xl": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=24, n_head=16, d_model=2048),
    "gpt3-2.7b": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=32, n_head=32, d_model=2560),
    "gpt3-6.7b": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=32, n_head=32, d_model=4096),
    "gpt3-13b": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=40, n_head=40, d_model=5120),
    "gpt3-175b": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
    # Mixture-of-Experts. tiny-moe: the tests' (4 experts, top-2, every other block, a shared expert). tiny-dsmoe:
    # DeepSeek-V3's router in small (16 narrow experts, top-4, sigmoid scores, 4 groups of which 2 kept, the weights
    # times 2.5, the balancing bias on, a small sequence-level auxiliary loss, a shared expert, one MTP depth).
    # switch-base-8: Switch Transformer's base shape with 8 experts (Fedus et al. 2021, table 9: d_model 768,
    # d_ff 3072, 12 heads, experts every other layer, top-1, capacity 1.25), as a decoder on GPT-2's
    # vocabulary. mixtral-shape: Mixtral 8x7B's widths (Jiang et al. 2024: d_model 4096, 32 layers, 32 heads,
    # 8 experts of 14336, top-2, dropless) with this GPT's attention and vocabulary (no GQA): for the planner.
    "tiny-moe": ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64, n_experts=4, top_k=2,
                            moe_every=2, d_expert=128, shared_expert=True),
    "tiny-dsmoe": ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64, n_experts=16, top_k=4,
                              moe_every=2, d_expert=32, shared_expert=True, router="sigmoid", expert_groups=4,
                              topk_groups=2, router_scale=2.5, expert_bias_rate=0.001, aux_loss_coef=0.0001,
                              mtp_depth=1),
    "switch-base-8": ModelConfig(vocab_size=50257, vocab_multiple=128, seq_len=1024, n_layer=12, n_head=12, d_model=768,
                                 n_experts=8, top_k=1, moe_every=2, capacity_factor=1.25),
    "mixtral-shape": ModelConfig(vocab_size=32000, vocab_multiple=128, seq_len=4096, n_layer=32, n_head=32,
                                 d_model=4096, n_experts=8, top_k=2, d_expert=14336),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """The named preset with some fields replaced, validated."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown model setting(s) {unknown}: ModelConfig has {sorted(known)}")
    config = replace(PRESETS[name], **overrides) if overrides else PRESETS[name]
    config.validate()
    return config
