"""How a MoE layer's tokens choose their experts (paratrain.nn.moe's docstring gives the rules): RouterSettings,
the Router (softmax or sigmoid scores, group-limited top-k, the balancing bias, the auxiliary terms) and the
per-sequence capacity."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config.model import ModelConfig
from paratrain.nn.loss import compute_dtype
from paratrain.nn.sequence import SequenceSplit


def capacity(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    """Assignments one expert takes from one sequence; 0 for dropless."""
    return math.ceil(capacity_factor * seq_len * top_k / n_experts) if capacity_factor > 0 else 0


def within_capacity(expert: torch.Tensor, n_experts: int, limit: int) -> torch.Tensor:
    """keep[B, S, k]: assignment (b, s, j) is among the first `limit` of its expert in sequence b, in
    the order all first choices by position, then all second choices (every one kept when limit is 0)."""
    if limit <= 0:
        return torch.ones_like(expert, dtype=torch.bool)
    batch, seq, k = expert.shape
    ordered = expert.transpose(1, 2).reshape(batch, k * seq)  # choice-major, then position
    onehot = F.one_hot(ordered, n_experts)
    position = (onehot.cumsum(dim=1) * onehot).sum(-1) - 1  # place of each assignment in its expert's queue
    return (position < limit).reshape(batch, k, seq).transpose(1, 2)


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing of a micro-batch of [B, S] tokens."""

    gate: torch.Tensor
    """[B, S, k] weights of the chosen experts (autograd to the router)."""
    expert: torch.Tensor
    """[B, S, k] expert ids."""
    keep: torch.Tensor
    """[B, S, k] False where capacity dropped the assignment."""
    balance: torch.Tensor
    """aux_coef * sum_b S * aux_b (scalar, autograd to the router)."""
    z: torch.Tensor
    """z_coef * sum_t z_t (scalar)."""


ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterSettings:
    """How a MoE layer routes (paratrain.config.model.ModelConfig's router fields)."""

    top_k: int = 1
    """Experts each token goes to (any k <= experts)."""
    scores: str = "softmax"
    """'softmax' over the experts (Switch, Mixtral, Qwen-MoE) or an independent 'sigmoid' per expert (DeepSeek-V3)."""
    groups: int = 1
    """Expert groups (DeepSeek's n_group): a token chooses among the experts of its topk_groups best groups only,
    a group scored by the sum of its two best experts' choice scores. 1: no group limit."""
    topk_groups: int = 1
    scale: float = 1.0
    """The chosen experts' weights are multiplied by this (DeepSeek's routed_scaling_factor)."""
    bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a bias per expert added to the scores for choosing only, moved
    by this much a step towards balance from the global batch's counts (update_bias); 0: no bias."""
    capacity_factor: float = 0.0
    aux_coef: float = 0.01
    global_aux_coef: float = 0.0
    """The global-batch balancing loss's weight (ModelConfig.global_aux_coef): it weighs the router probabilities by
    the previous global batch's load fractions (the `load` buffer, moved by after_step); 0: off."""
    z_coef: float = 0.001

    @classmethod
    def of(cls, config: ModelConfig) -> RouterSettings:
        """The routing of the GPT's MoE layers, from its config."""
        return cls(top_k=config.top_k, scores=config.router, groups=config.expert_groups, topk_groups=config.topk_groups,
                   scale=config.router_scale, bias_rate=config.expert_bias_rate,
                   capacity_factor=config.capacity_factor, aux_coef=config.aux_loss_coef,
                   global_aux_coef=config.global_aux_coef, z_coef=config.z_loss_coef)


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, settings: RouterSettings) -> None:
        super().__init__()
        if settings.scores not in ROUTERS:
            raise ValueError(f"router scores must be one of {ROUTERS}, got {settings.scores!r}")
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.n_experts, self.settings = n_experts, settings
        self.top_k, self.capacity_factor = settings.top_k, settings.capacity_factor
        self.aux_coef, self.z_coef = settings.aux_coef, settings.z_coef
        if settings.bias_rate > 0:  # state, not a parameter: in checkpoints, moved by update_bias
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        if settings.global_aux_coef > 0:  # the previous global batch's load fractions (uniform before the first)
            self.register_buffer("load", torch.full((n_experts,), 1.0 / n_experts, dtype=torch.float64))

    @property
    def moves(self) -> bool:
        """Whether the router keeps state a step moves (after_step): the balancing bias, the load fractions."""
        return self.settings.bias_rate > 0 or self.settings.global_aux_coef > 0

    @property
    def reads_fixed_split(self) -> str:
        """Why this router cannot follow a split that changes by micro-batch: capacity counts each sequence's tokens
        in the fixed split's order ("" when dropless)."""
        return f"expert capacity ({self.capacity_factor:g}) counts tokens in the fixed split's order" \
            if self.capacity_factor > 0 else ""

    def forward(self, x: torch.Tensor, sequence: SequenceSplit | None = None) -> Routing:
        """x [B, S, D]: S tokens of each sequence, all of it, or this rank's part under `sequence`."""
        with _no_autocast(x.device):  # routing in float32 at least, also under mixed precision
            return self._route(x, sequence)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """[B, S, k] expert ids: the top k of the scores plus the balancing bias, within the best groups."""
        settings = self.settings
        choice = scores + self.expert_bias.to(scores.dtype) if settings.bias_rate > 0 else scores
        if settings.groups > 1:
            grouped = choice.unflatten(-1, (settings.groups, self.n_experts // settings.groups))
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [B, S, groups]
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(
                -1, best.topk(settings.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)
        return torch.topk(choice, self.top_k, dim=-1).indices

    def _route(self, x: torch.Tensor, sequence: SequenceSplit | None) -> Routing:
        batch, local, _ = x.shape
        seq = local * (sequence.parts if sequence is not None else 1)  # tokens of a whole sequence
        logits = F.linear(x.to(compute_dtype(x.dtype)), self.weight.to(compute_dtype(x.dtype)))  # [B, S, E]
        if self.settings.scores == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)  # what the balancing loss weighs (DeepSeek's)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        expert = self._choose(scores.detach())
        gate = scores.gather(-1, expert)
        if self.top_k > 1 or self.settings.scores == "sigmoid":  # the chosen weights sum to 1 (Mixtral, DeepSeek)
            gate = gate / gate.sum(dim=-1, keepdim=True)
        if self.settings.scale != 1.0:
            gate = gate * self.settings.scale
        keep = self._keep(expert, seq, sequence)
        routed = F.one_hot(expert, self.n_experts).sum(dim=2).to(probs.dtype)  # [B, S, E] assignments per token
        counts = routed.sum(dim=1)  # [B, E], this rank's tokens
        if sequence is not None:
            counts = sequence.sum(counts)
        fraction = counts / (seq * self.top_k)  # f[B, E]
        # aux_coef * sum_b S aux_b = aux_coef * E * sum_b,e f_be * (sum over b's tokens of p_bse): this rank's tokens'
        balance = self.aux_coef * self.n_experts * (fraction * probs.sum(dim=1)).sum()
        if self.settings.global_aux_coef > 0:  # E sum_e f_e P_e over the global batch: this rank's tokens' share
            balance = balance + self.settings.global_aux_coef * self.n_experts * (
                probs.sum(dim=(0, 1)) * self.load.to(probs.dtype)).sum()
        z = self.z_coef * torch.logsumexp(logits, dim=-1).pow(2).sum()
        return Routing(gate, expert, keep, balance, z)

    @torch.no_grad()
    def after_step(self, counts: torch.Tensor) -> None:
        """A step was taken, whose global batch gave each expert `counts` [E] assignments (integers summed over
        every rank that routed tokens): the bias moves (update_bias), the load fractions become these."""
        if self.settings.bias_rate > 0:
            self.update_bias(counts)
        if self.settings.global_aux_coef > 0:
            counts = counts.to(self.load.device, torch.float64)
            self.load.copy_(counts / counts.sum().clamp(min=1.0))

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Move the balancing bias one step from the global batch's assignments per expert `counts` [E]: up by
        bias_rate where an expert got fewer than the mean, down where more (DeepSeek-V3's rule). The counts are
        integers summed over every rank that routed tokens, so every layout moves it alike."""
        counts = counts.to(self.expert_bias.device, torch.float64)
        self.expert_bias += self.settings.bias_rate * torch.sign(counts.mean() - counts).to(self.expert_bias.dtype)

    def _keep(self, expert: torch.Tensor, seq: int, sequence: SequenceSplit | None) -> torch.Tensor:
        """keep [B, S, k] of this rank's assignments, counted over the whole sequence of S tokens."""
        limit = capacity(self.capacity_factor, seq, self.top_k, self.n_experts)
        if sequence is None or limit <= 0:
            return within_capacity(expert, self.n_experts, limit)
        whole = within_capacity(sequence.gather(expert, dim=1), self.n_experts, limit)  # [B, S, k], by position
        return whole.index_select(1, sequence.positions(expert.shape[1], expert.device))


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
