"""AdamW whose moments may be stored in 16 bits (the float32 master kept), as torchtitan's and Megatron's
precision-aware optimizers keep them.

The step computes in the master's dtype: each moment is read up from its storage, updated, rounded back into it,
and the update uses the unrounded value (so a 16-bit state loses nothing within a step, only between steps). With
the state in the parameter's own dtype the step is torch.optim.AdamW's functional, bit for bit.

    state bytes per element: float32 moments 8 (AdamW) / 4 (Muon's momentum); bfloat16 4 / 2
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype


def adamw_step(state: dict[torch.Tensor, Any], params: Iterable[torch.Tensor], *, lr: float, betas: tuple[float, float],
               eps: float, weight_decay: float, state_dtype: torch.dtype | None) -> None:
    """One AdamW step over `params` (those with a gradient), their state in `state` (an optimizer's) as torch keeps
    it (step, exp_avg, exp_avg_sq), the moments in `state_dtype` (None: each parameter's own)."""
    held, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in params:
        if p.grad is None:
            continue
        own = state[p]
        if not own:
            own["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
            own["exp_avg"] = torch.zeros_like(p, dtype=state_dtype or p.dtype, memory_format=torch.preserve_format)
            own["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype or p.dtype, memory_format=torch.preserve_format)
        held.append(p)
        grads.append(p.grad)
        exp_avgs.append(own["exp_avg"])
        exp_avg_sqs.append(own["exp_avg_sq"])
        steps.append(own["step"])
    beta1, beta2 = betas
    same = [i for i, p in enumerate(held) if exp_avgs[i].dtype == p.dtype]
    if same:  # torch's own step
        adam([held[i] for i in same], [grads[i] for i in same], [exp_avgs[i] for i in same],
             [exp_avg_sqs[i] for i in same], [], [steps[i] for i in same], decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    for i, p in enumerate(held):
        if exp_avgs[i].dtype == p.dtype:
            continue
        steps[i] += 1
        step = float(steps[i])
        grad = grads[i].to(p.dtype)
        p.mul_(1 - lr * weight_decay)
        m = exp_avgs[i].to(p.dtype).lerp_(grad, 1 - beta1)
        v = exp_avg_sqs[i].to(p.dtype).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))


def closure_loss(closure: Any) -> Any:
    """torch.optim's closure convention: the loss it returns, evaluated with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with `state_dtype` moments (None: the parameters' dtype: torch's step exactly)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_dtype: torch.dtype | None = None) -> None:
        if state_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"state_dtype must be None, float32, bfloat16 or float16, got {state_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            adamw_step(self.state, group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                       weight_decay=group["weight_decay"], state_dtype=self.state_dtype)
        return loss
