"""The optimizer a run's [optim] section names, as a factory for parallelize: AdamW with weight decay on matrices
only (not on norms, biases or other vectors), Muon on the matrices with AdamW on the rest (paratrain.optim), or SGD
with momentum; optim.state_dtype 'bf16' keeps AdamW's moments and Muon's momentum in bfloat16."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from paratrain.config.run import OptimSection
from paratrain.optim import EXCLUDE, AdamW, AdamWSettings, MuonFactory, MuonSettings

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(optim: OptimSection) -> Factory:
    """The factory of `optim.optimizer` (validated by paratrain.config.validate)."""
    state = None if optim.state_dtype == "fp32" else NS_DTYPES[optim.state_dtype]
    if optim.optimizer == "muon":
        return MuonFactory(
            MuonSettings(lr=optim.lr, weight_decay=optim.weight_decay, momentum=optim.muon_momentum,
                         nesterov=optim.muon_nesterov, ns_steps=optim.muon_ns_steps, adjust_lr_fn=optim.muon_adjust_lr,
                         ns_dtype=NS_DTYPES[optim.muon_ns_dtype], momentum_dtype=state),
            AdamWSettings(betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
                          state_dtype=state),
            exclude=optim.muon_exclude or EXCLUDE)
    if optim.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=optim.lr, momentum=0.9)
    return adamw_factory(optim)


def adamw_factory(optim: OptimSection) -> Factory:
    """AdamW that decays parameters of 2+ dims (as nanoGPT, GPT-3)."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": optim.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        kept = [g for g in groups if g["params"]]
        if optim.state_dtype != "fp32":  # 16-bit moments beside the float32 master
            return AdamW(kept, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                         state_dtype=NS_DTYPES[optim.state_dtype])
        return torch.optim.AdamW(kept, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)

    return build
