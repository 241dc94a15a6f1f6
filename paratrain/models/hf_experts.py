"""Expert parallelism for the Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

transformers keeps each MoE layer's experts in one module, `model.layers.{i}.mlp.experts`, with two stacked weights,
gate_up_proj [E, 2I, D] (expert e: its gate rows, then its up rows) and down_proj [E, D, I], called as
experts(hidden[T, D], top_k_index[T, k], top_k_weights[T, k]) -> [T, D]. Under ep, each rank keeps E / ep experts'
rows of both weights (paratrain.expert_parallel cuts dim 0, keeping the Parameters), and the module is replaced, in
its parent, by RoutedExperts: the same Parameters under the same names, whose forward hands the T k (token, choice)
rows to the ep runner (the all-to-all that brings each row to the rank holding its expert and back), runs its local
experts as HF's loop does (act(gate) * up, then down), and sums each token's k outputs times their weights in the
order of its choices. The router, the shared experts and everything else stay HF's own, replicated over ep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.nn.recipe import ExpertBank, ExpertRunner

WEIGHTS = ("gate_up_proj", "down_proj")


class RoutedExperts(nn.Module):
    """An HF experts module whose rows go through an ExpertRunner (module docstring)."""

    def __init__(self, experts: nn.Module, runner: ExpertRunner) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj  # the same Parameters
        self.act_fn, self.num_experts, self.runner = experts.act_fn, experts.num_experts, runner

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        rows = hidden_states.repeat_interleave(k, dim=0)  # [T k, D]: token-major, each token's choices in order
        out = self.runner(rows, top_k_index.reshape(-1), self.run_local)
        weighted = out.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(out.dtype)
        return weighted.sum(dim=1)

    def run_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by this rank's experts (counts[e] rows for local expert e) -> their outputs, in order."""
        outputs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outputs.append(self._expert(rows[start: start + n], e))
            start += n
        # no rows: an empty result still attached to the rows and weights, so every rank's backward runs the
        # all-to-all that brought them and reaches the weights' gradient hooks
        return torch.cat(outputs) if outputs else self._expert(rows[:0], 0)

    def _expert(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])


def hf_expert_banks(model: nn.Module) -> list[ExpertBank]:
    """Every `*.mlp.experts` module of an HF MoE family as an ExpertBank (paratrain.nn.recipe)."""
    banks = []
    for name, module in model.named_modules():
        if not (name.endswith(".mlp.experts") and all(hasattr(module, w) for w in WEIGHTS)):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])

        def route(runner: ExpertRunner, parent: nn.Module = parent, experts: nn.Module = module) -> None:
            parent.experts = RoutedExperts(experts, runner)

        banks.append(ExpertBank(name, WEIGHTS, int(module.num_experts), route))
    return banks
