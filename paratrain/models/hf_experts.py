"""Expert parallelism for the Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss).

transformers keeps each MoE layer's experts in one module, `model.layers.{i}.mlp.experts`, whose parameters are all
stacked by expert along dim 0 (gate_up_proj, down_proj, and gpt-oss's biases), called as
experts(hidden[T, D], top_k_index[T, k], top_k_weights[T, k]) -> [T, D]. Under ep, each rank keeps E / ep experts'
rows of each (paratrain.expert_parallel cuts dim 0, keeping the Parameters), and the module is replaced, in its
parent, by RoutedExperts: the same Parameters under the same names, whose forward hands the T k (token, choice) rows
to the ep runner (the all-to-all that brings each row to the rank holding its expert and back), runs the rows that
arrive through the family's own experts forward (now over this rank's experts), and sums each token's k outputs
times their weights in the order of its choices. The router, the shared experts and everything else stay HF's own,
replicated over ep.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.nn.recipe import ExpertBank, ExpertRunner

WEIGHTS = ("gate_up_proj", "down_proj")
"""The stacked weights every family has; their biases (gpt-oss's) are stacked by expert too."""


class RoutedExperts(nn.Module):
    """An HF experts module whose rows go through an ExpertRunner (module docstring). It takes the module's
    Parameters over under their own names and runs the module's own forward on the rows that reach this rank, each
    with weight 1 for its one local expert (exact: times 1.0, added to zero), so every family's expert math (gate and
    up concatenated or interleaved, biases, clamped activations, grouped or looped kernels) is transformers' own."""

    def __init__(self, experts: nn.Module, runner: ExpertRunner, local: int) -> None:
        super().__init__()
        for name, param in experts.named_parameters(recurse=False):
            self.register_parameter(name, param)  # the same Parameters: names, checkpoints and gradients unchanged
        experts.num_experts = local  # its loop and kernels index this rank's experts
        self.__dict__["local_experts"] = experts  # not registered: its parameters are this module's
        self.runner = runner

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        rows = hidden_states.repeat_interleave(k, dim=0)  # [T k, D]: token-major, each token's choices in order
        out = self.runner(rows, top_k_index.reshape(-1), self.run_local)
        weighted = out.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(out.dtype)
        return weighted.sum(dim=1)

    def run_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by this rank's experts (counts[e] rows for local expert e) -> their outputs, in order."""
        if not rows.shape[0]:  # an empty result still attached to the rows and weights, so every rank's backward runs
            # the all-to-all that brought them and reaches the weights
            return rows * 0 + sum(p.sum() for p in self.parameters()) * 0
        ids = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                      torch.tensor(counts, device=rows.device), output_size=rows.shape[0])
        return self.local_experts(rows, ids.unsqueeze(1), rows.new_ones(rows.shape[0], 1))


def hf_expert_banks(model: nn.Module) -> list[ExpertBank]:
    """Every `*.mlp.experts` module of an HF MoE family as an ExpertBank (paratrain.nn.recipe)."""
    banks = []
    for name, module in model.named_modules():
        if not (name.endswith(".mlp.experts") and all(hasattr(module, w) for w in WEIGHTS)):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        stacked = tuple(n for n, _ in module.named_parameters(recurse=False))  # dim 0: the experts

        def route(runner: ExpertRunner, parent: nn.Module = parent, experts: nn.Module = module) -> None:
            parent.experts = RoutedExperts(experts, runner, experts.gate_up_proj.shape[0])

        banks.append(ExpertBank(name, stacked, int(module.num_experts), route))
    return banks
