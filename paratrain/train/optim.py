"""AdamW with weight decay on matrices only (not on norms, biases or other vectors)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from paratrain.config.run import OptimSection


def adamw_factory(model: nn.Module, optim: OptimSection) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory for parallelize(): decays parameters of 2+ dims (as nanoGPT, GPT-3)."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": optim.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr,
                                 betas=(optim.beta1, optim.beta2), eps=optim.eps)

    return build
