"""Mixture-of-Experts MLP for the reference GPT: a top-k router (softmax or sigmoid scores, group-limited choice, an
auxiliary-loss-free balancing bias), E expert MLPs, the Switch load-balancing loss and the router z-loss, a
per-sequence capacity or none (dropless).

Names (the contract strategies read, as in gpt.py):

    blocks.{i}.moe.router        Linear D -> E (no bias), computed in float32 at least
    blocks.{i}.moe.experts.up    Parameter[E, F, D]  (expert e's up projection is up[e], as nn.Linear's weight)
    blocks.{i}.moe.experts.down  Parameter[E, D, F]
    blocks.{i}.moe.shared        MLP (up, down), on every token, when the model has a shared expert

Routing (RouterSettings). scores = softmax(x Wr^T) over the E experts, or sigmoid(x Wr^T) per expert (DeepSeek-V3);
each token goes to the top_k experts of scores + bias (the balancing bias, DeepSeek-V3's auxiliary-loss-free
balancing: it moves the choice and never the weights), among the experts of its topk_groups best groups when the
experts are grouped (a group scored by its two best experts), weighted by their scores, renormalised over the k
(when k > 1, as Mixtral does, and always for sigmoid scores), times `scale`. The k outputs of a token are summed in
the order of its choices, so the sum is the same wherever the experts ran. The bias moves after each step by
bias_rate towards balance from the global batch's assignments per expert (Router.update_bias; the engine sums the
counts over every rank that routed tokens, paratrain.hybrid.experts), so it is the same in every layout.

Capacity, per sequence. With capacity_factor c > 0, expert e takes at most C = ceil(c * S * k / E)
of the S * k assignments of one sequence: first choices before second ones, each in sequence order
(GShard's priority); an assignment past C is dropped (its token keeps only the residual, and the
shared expert). Counted per sequence, which tokens are dropped depends on nothing but the sequence,
so it is the same under any dp, accumulation or expert-parallel layout (DeepSpeed and Megatron count
capacity per rank's micro-batch: then the drops change with the layout). c = 0: dropless.

Under context or sequence parallelism (a SequenceSplit: each rank holds part of every sequence, and
routes its own tokens) the layer keeps
both per-sequence rules: the expert choices of the whole sequence are gathered (in position order) to
count capacity, and the routed fractions f_be are summed over the sequence's ranks; each rank then
keeps its tokens' drops and adds its tokens' share of the balancing term, so the sums over the ranks
are one process's.

Auxiliary losses, additive over sequences and tokens so that the global batch's value does not depend
on how it is cut. Switch load balancing (Fedus et al. 2021, eq. 4), per sequence b:
aux_b = E * sum_e f_be * P_be, f_be the fraction of b's assignments routed to e (before capacity),
P_be the mean router probability of e over b's tokens (so S aux_b = E sum_e f_be sum_s p_bse, a sum
over tokens, each rank adding its own); router z-loss (Zoph et al. 2022, ST-MoE,
eq. 5): z_t = logsumexp(router logits of token t)^2. Their terms enter the loss *sum* as
aux_coef * S * aux_b per sequence and z_coef * z_t per token; the engine divides the sum by the
global batch's token count, so they weigh as a mean over sequences and over tokens.

The gradient of those terms is injected at the layer (AddToLoss), not carried to the loss function:
the layer's output passes through unchanged and, in backward, the terms receive the gradient the loss
sum's backward starts with (RouterLog.grad_scale: 1, or fp16's loss scale). So a MoE layer on any
pipeline stage trains with its auxiliary losses though only the last stage computes the loss. Their
values go to the RouterLog the layer is attached to (the engine's, which adds them to the step's loss
and reports tokens per expert and drops; or the model's own, for use without an engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.eager import eager
from paratrain.nn.router import Router, RouterSettings
from paratrain.nn.sequence import SequenceSplit


@dataclass
class RouterLog:
    """What the MoE layers attached to it add up between resets (training forwards only; a
    recomputation in backward adds nothing)."""

    grad_scale: float = 1.0
    """The gradient the loss sum's backward starts with: the auxiliary terms receive it."""
    aux_sum: torch.Tensor | None = None
    """Sum of every auxiliary term (float64, detached): what the loss sum lacks."""
    balance_sum: torch.Tensor | None = None
    """aux_coef * S * aux_b summed over sequences and layers."""
    z_sum: torch.Tensor | None = None
    """z_coef * z_t summed over tokens and layers."""
    expert_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    """Layer name -> assignments each expert received (after capacity), [E], float64."""
    dropped: torch.Tensor | None = None
    """Assignments dropped by capacity."""
    assigned: torch.Tensor | None = None
    """Assignments made (tokens x top_k)."""
    moving: dict[str, Router] = field(default_factory=dict)
    """Layer name -> its router, for the layers whose routers keep state a step moves (a balancing bias, the load
    fractions of the global-batch loss): after_step moves them."""

    def scale_gradients(self, scale: float) -> None:
        """The coming backward starts from the loss sum times `scale` (fp16's loss scale, else 1): the
        auxiliary terms receive the same."""
        self.grad_scale = scale

    def after_step(self, counts: dict[str, torch.Tensor]) -> None:
        """After a step: each moving router's state moved from the global batch's assignments per expert (`counts`,
        by layer name, summed over every rank that routed tokens: paratrain.hybrid.experts.routing_totals)."""
        for name, router in self.moving.items():
            router.after_step(counts[name])

    def reset(self) -> None:
        self.aux_sum = self.balance_sum = self.z_sum = self.dropped = self.assigned = None
        self.expert_tokens = {}

    def add(self, name: str, balance: torch.Tensor, z: torch.Tensor, tokens: torch.Tensor, dropped: torch.Tensor,
            assigned: int) -> None:
        balance, z = balance.detach().double(), z.detach().double()
        self.balance_sum = balance if self.balance_sum is None else self.balance_sum + balance
        self.z_sum = z if self.z_sum is None else self.z_sum + z
        self.aux_sum = balance + z if self.aux_sum is None else self.aux_sum + balance + z
        tokens = tokens.detach().double()
        self.expert_tokens[name] = tokens if name not in self.expert_tokens else self.expert_tokens[name] + tokens
        dropped = dropped.detach().double()
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        self.assigned = (self.assigned or 0) + assigned


class AddToLoss(torch.autograd.Function):
    """y = x in forward; in backward, `terms` (a scalar that belongs to the loss sum) gets log.grad_scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, terms: torch.Tensor, log: RouterLog) -> torch.Tensor:  # type: ignore[override]
        ctx.log, ctx.dtype = log, terms.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.tensor(ctx.log.grad_scale, dtype=ctx.dtype, device=grad.device), None


class Experts(nn.Module):
    """E expert MLPs (GELU) as two stacked weights; runs rows already grouped by expert."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows[N, D] grouped by this module's experts (counts[e] rows for expert e) -> [N, D]."""
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                chunk = rows[start: start + n]
                hidden = F.gelu(F.linear(chunk, self.up[e]), approximate="tanh")
                outputs.append(F.linear(hidden, self.down[e]))
            start += n
        if outputs:
            return torch.cat(outputs)
        # No rows: an empty result still attached to `rows`, so that backward reaches (and, under expert
        # parallelism, every rank runs) the all-to-all that brought them, and to the weights, whose gradient
        # hooks (sequence parallelism sums them over tp) must fire on every rank, here with zeros
        return F.linear(F.gelu(F.linear(rows[:0], self.up[0]), approximate="tanh"), self.down[0])


def balanced(rows: int, experts: int) -> list[int]:
    """`rows` split as evenly as they go over `experts` (the first ones one more): the dry run's routing, on meta
    tensors that carry no expert ids."""
    return [rows // experts + (e < rows % experts) for e in range(experts)]


ExpertRunner = Callable[[torch.Tensor, torch.Tensor, "Experts"], torch.Tensor]
"""run(rows[N, D], expert_ids[N], experts) -> outputs[N, D]: where the experts run (here, or over ep ranks)."""


def run_here(rows: torch.Tensor, expert_ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert on this process: rows grouped by expert (stable), run, put back in place."""
    order = torch.argsort(expert_ids, stable=True)
    counts = (balanced(rows.shape[0], experts.up.shape[0]) if rows.is_meta  # the planner's dry run: no ids
              else torch.bincount(expert_ids, minlength=experts.up.shape[0]).tolist())  # every expert is here
    out = experts(rows[order], counts)
    return torch.empty_like(out).index_copy_(0, order, out)


class MoE(nn.Module):
    def __init__(self, d_model: int, *, n_experts: int, d_ff: int, router: RouterSettings,
                 shared: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(d_model, n_experts, router)
        self.experts = Experts(n_experts, d_model, d_ff)
        self.shared = shared
        self.log = RouterLog()
        """Where this layer's auxiliary losses and counts go (the engine attaches its own)."""
        self.log_name = ""
        self.run_experts: ExpertRunner = run_here
        """Expert parallelism replaces it with a runner that sends rows to the ranks holding their experts."""
        self.sequence: SequenceSplit | None = None
        """Context parallelism: this rank holds part of each sequence (split_sequence)."""

    def split_sequence(self, sequence: SequenceSplit) -> None:
        """Route a part of each sequence (context or sequence parallelism): capacity and load balancing stay
        per whole sequence (the module docstring). A split given later is of a longer sequence (context
        parallelism's part, which sequence parallelism's chunks, given first, lie inside)."""
        self.sequence = sequence if self.sequence is None else self.sequence.within(sequence)

    def run_with(self, runner: ExpertRunner) -> None:
        """Run the experts with `runner` (expert parallelism: one that sends rows to the ranks holding
        their experts)."""
        self.run_experts = runner

    def attach(self, log: RouterLog, name: str) -> None:
        self.log, self.log_name = log, name

    @eager  # routing makes shapes that depend on the data: under torch.compile the layer runs eagerly between
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # its block's compiled parts (as collectives do)
        batch, seq, d = x.shape
        k = self.router.top_k
        routing = self.router(x, self.sequence)
        kept = routing.keep.reshape(-1)
        if x.is_meta:  # the planner's dry run (shapes only): every assignment runs, spread evenly over the experts
            assignments = torch.arange(kept.numel(), device=x.device)
        else:
            assignments = torch.nonzero(kept).squeeze(1)  # (token, choice) pairs that run, token-major
        rows = x.reshape(-1, d)[assignments // k]
        # Always run, even with no rows: under expert parallelism every rank must enter the all-to-alls.
        out = self.run_experts(rows, routing.expert.reshape(-1)[assignments], self.experts)
        per_assignment = x.new_zeros(batch * seq * k, d).index_copy(0, assignments, out)
        weights = (routing.gate * routing.keep).to(x.dtype).unsqueeze(-1)
        y = (per_assignment.view(batch, seq, k, d) * weights).sum(dim=2)  # the k outputs, in choice order
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training and torch._C._current_graph_task_id() == -1:  # not a recomputation in backward
            chosen, n = routing.expert.reshape(-1)[assignments], self.router.n_experts
            tokens = chosen.new_zeros(n) if x.is_meta else torch.bincount(chosen, minlength=n)
            self.log.add(self.log_name, routing.balance, routing.z, tokens, (~kept).sum(), kept.numel())
        if not torch.is_grad_enabled():
            return y
        return AddToLoss.apply(y, routing.balance + routing.z, self.log)
