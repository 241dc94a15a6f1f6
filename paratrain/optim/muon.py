"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") on the weight matrices, AdamW on
the rest, as one optimizer whose matrix step runs wherever the layout keeps the matrices (paratrain.optim.matrices).

Per matrix W with gradient G, momentum mu, learning rate lr and weight decay wd (torch.optim.Muon's algorithm):

    B <- mu B + (1 - mu) G                      per element (B: the "momentum_buffer" state)
    U <- G + mu (B - G) ... nesterov: lerp(G, B, mu); else B        per element
    O <- NewtonSchulz(U)                        the whole matrix: 5 quintic iterations towards U V^T (in bfloat16
                                                by default, as torch; `ns_dtype` float32 / float64 for checks)
    W <- W (1 - lr wd) - adjust(lr, rows, cols) O

so only NewtonSchulz needs a whole matrix: the step hands it to a Matrices (one process: LocalMatrices; under a
layout: paratrain.optim.exchange.MatrixExchange). In one process `Muon(...).step()` equals torch.optim.Muon on the
matrices plus torch.optim.AdamW on the rest (tests/unit/test_muon.py).

Which parameters are matrices: every parameter of 2 or more dims (a 3-D tensor's leading slices each one matrix:
a MoE layer's experts), except embeddings and the output head, which AdamW updates with vectors and scalars (Keller
Jordan's and Moonshot's choice). Given names (`Muon(model.named_parameters())`, or paratrain's factory under
parallelize), the names matching `exclude` go to AdamW; given bare tensors, dims alone decide.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from paratrain.optim.adamw import adamw_step, closure_loss
from paratrain.optim.matrices import LocalMatrices, Matrices

ADJUST_LR = ("original", "match_rms_adamw", "none")
EXCLUDE = r"(^|\.)(tok_emb|pos_emb|wte|wpe|embed_tokens|embed_positions|embeddings?|lm_head|head|output|score)(\.|$)"
"""Parameter names AdamW keeps (embeddings and output heads of paratrain's GPT and the HF families)."""
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyper-parameters (torch.optim.Muon's names and defaults) and the Newton-Schulz dtype."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    ns_steps: int = 5
    eps: float = 1e-7
    adjust_lr_fn: str = "original"
    """'original': lr sqrt(max(1, rows / cols)) (Keller Jordan's); 'match_rms_adamw': 0.2 lr sqrt(max(rows, cols))
    (Moonshot's: the update's RMS matches AdamW's, so AdamW's lr and weight decay carry over); 'none': lr."""
    ns_dtype: torch.dtype = torch.bfloat16
    """Newton-Schulz runs in this dtype (torch.optim.Muon: bfloat16); the update is added in the parameter's."""
    momentum_dtype: torch.dtype | None = None
    """The momentum's storage (bfloat16: half the bytes; updated in the parameter's dtype, rounded back); None: the
    gradient's dtype."""

    def __post_init__(self) -> None:
        problems = []
        if not self.lr >= 0:
            problems.append(f"lr must be >= 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum must be in [0, 1), got {self.momentum} (usual: 0.95)")
        if not self.weight_decay >= 0:
            problems.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 1 <= self.ns_steps < 100:
            problems.append(f"ns_steps must be in [1, 100), got {self.ns_steps} (usual: 5)")
        if not self.eps > 0:
            problems.append(f"eps must be > 0, got {self.eps}")
        if self.adjust_lr_fn not in ADJUST_LR:
            problems.append(f"adjust_lr_fn must be one of {ADJUST_LR}, got {self.adjust_lr_fn!r}")
        if self.ns_dtype not in NS_DTYPES:
            problems.append(f"ns_dtype must be one of {NS_DTYPES}, got {self.ns_dtype}")
        if len(self.ns_coefficients) != 3:
            problems.append(f"ns_coefficients must be 3 numbers (a, b, c), got {self.ns_coefficients}")
        if problems:
            raise ValueError("Muon: " + "; ".join(problems))


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW's hyper-parameters for the parameters Muon leaves (its lr follows the Muon group's: Engine.set_lr
    sets every group's)."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """On the excluded matrices (embeddings, head); vectors and scalars never decay."""
    state_dtype: torch.dtype | None = None
    """The moments' storage (bfloat16: half the bytes, the float32 master kept); None: the parameters' dtype."""


def newton_schulz(matrix: torch.Tensor, *, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor U V^T of `matrix` = U S V^T (Keller
    Jordan's; torch.optim.Muon's, op for op), in `dtype`."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: tuple[int, int]) -> float:
    rows, cols = shape
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def is_matrix(name: str, shape: tuple[int, ...], exclude: str = EXCLUDE) -> bool:
    """Muon's or AdamW's: 2+ dims and a name `exclude` does not match."""
    return len(shape) >= 2 and re.search(exclude, name) is None


class Muon(torch.optim.Optimizer):
    """Muon on the matrices, AdamW on the rest (param groups of kind 'muon', 'adamw' with decay, 'adamw' without).

        opt = Muon(model.named_parameters(), MuonSettings(lr=0.02), AdamWSettings())

    params: tensors, or (name, tensor) pairs (names choose with `exclude`; see the module's doc).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 muon: MuonSettings = MuonSettings(), adamw: AdamWSettings = AdamWSettings(), *,
                 exclude: str = EXCLUDE) -> None:
        matrices, decayed, rest = [], [], []
        for item in params:
            name, tensor = item if isinstance(item, tuple) else (None, item)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"Muon takes tensors or (name, tensor) pairs, got {type(item).__name__}")
            if tensor.dim() < 2:
                rest.append(tensor)
            elif name is None or is_matrix(name, tuple(tensor.shape), exclude):
                matrices.append(tensor)
            else:
                decayed.append(tensor)
        common = {"lr": muon.lr}
        groups: list[dict[str, Any]] = [
            {"params": matrices, "kind": "muon", **common, "weight_decay": muon.weight_decay},
            {"params": decayed, "kind": "adamw", **common, "weight_decay": adamw.weight_decay},
            {"params": rest, "kind": "adamw", **common, "weight_decay": 0.0},
        ]
        super().__init__([g for g in groups if g["params"]], {})
        self.muon = muon
        self.adamw = adamw
        self.matrix_step = functools.partial(newton_schulz, coefficients=tuple(muon.ns_coefficients),
                                             steps=muon.ns_steps, eps=muon.eps, dtype=muon.ns_dtype)

    @property
    def matrix_dtype(self) -> torch.dtype:
        return self.muon.ns_dtype

    def matrix_tensors(self) -> list[torch.Tensor]:
        """The tensors it updates as matrices now (parameters, or the flat shards ZeRO pointed it at)."""
        return [t for g in self.param_groups if g["kind"] == "muon" for t in g["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One step with every matrix whole on this rank (one process)."""
        loss = closure_loss(closure)
        self.step_with(LocalMatrices())
        return loss

    @torch.no_grad()
    def step_with(self, matrices: Matrices) -> None:
        """One step, the Newton-Schulz of every matrix run by `matrices` (collective for an exchange)."""
        held: list[tuple[torch.Tensor, float, float]] = []  # (tensor, lr, weight decay) with a gradient
        inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        mu, settings = self.muon.momentum, self.muon
        for group in self.param_groups:
            if group["kind"] != "muon":
                self._adamw(group)
                continue
            for p in group["params"]:
                if p.grad is None:  # an exchange still needs every tensor's part: zeros, and no update
                    inputs.append((p, torch.zeros_like(p, dtype=settings.ns_dtype)))
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=settings.momentum_dtype or p.grad.dtype,
                                                                memory_format=torch.preserve_format)
                stored = state["momentum_buffer"]
                buf = stored if stored.dtype == p.grad.dtype else stored.to(p.grad.dtype)
                buf.lerp_(p.grad, 1 - mu)
                if buf is not stored:  # kept in 16 bits: rounded back, used unrounded
                    stored.copy_(buf)
                update = p.grad.lerp(buf, mu) if settings.nesterov else buf
                inputs.append((p, update.to(settings.ns_dtype)))
                held.append((p, group["lr"], group["weight_decay"]))
        outputs = matrices.apply(inputs, self.matrix_step)
        updates = {id(p): out for (p, _), out in zip(inputs, outputs)}
        for p, lr, decay in held:
            p.mul_(1 - lr * decay)
            flat, out = p.view(-1), updates[id(p)].reshape(-1)
            for seg in matrices.segments(p):
                end = seg.offset + seg.length
                flat[seg.offset: end].add_(out[seg.offset: end],
                                           alpha=-adjusted_lr(lr, settings.adjust_lr_fn, seg.shape))

    def _adamw(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step over the group (its functional and state layout: step, exp_avg, exp_avg_sq;
        the moments in AdamWSettings.state_dtype)."""
        adamw_step(self.state, group["params"], lr=group["lr"], betas=self.adamw.betas, eps=self.adamw.eps,
                   weight_decay=group["weight_decay"], state_dtype=self.adamw.state_dtype)


@dataclass(frozen=True)
class MuonFactory:
    """Builds Muon for parallelize (a paratrain.optim.NamedFactory: matrices chosen by name, `exclude` to AdamW)."""

    muon: MuonSettings = MuonSettings()
    adamw: AdamWSettings = AdamWSettings()
    exclude: str = EXCLUDE

    def __call__(self, params: list[torch.nn.Parameter]) -> Muon:
        return Muon(params, self.muon, self.adamw, exclude=self.exclude)

    def named(self, params: list[tuple[str, torch.nn.Parameter]]) -> Muon:
        return Muon(params, self.muon, self.adamw, exclude=self.exclude)
