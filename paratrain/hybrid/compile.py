"""torch.compile per transformer block, applied from outside by module name (as torchtitan does).

Each matching module's forward is replaced on the instance by its compiled self, after tensor
parallelism and recomputation have changed it and before activation offload wraps it, so that:
  - parameter names, and with them checkpoints, TP plans and ZeRO's units, stay the model's own;
  - module hooks (ZeRO-3's gathers, prefetches and frees) run eagerly around the compiled forward;
  - a recomputed block is compiled with its checkpoint inside (inductor then decides what to keep);
  - offloaded activations are what the compiled graph saves (offload's hooks run around it);
  - every block of one model shares one compiled graph (same code, same shapes): one compilation.
What is not compiled, and why:
  - collectives (paratrain.comm.regions, the sequence-parallel linear): torch.compiler.disable marks
    them, so dynamo breaks the graph there and they run eagerly, in the order every rank agrees on;
  - keyed dropout with p > 0: its key changes every step (a graph per step otherwise);
  - the embedding, the final norm, the head and the loss: outside the blocks (the chunked loss is
    a Python loop over row chunks; the head is one matmul).
"""

from __future__ import annotations

import re

import torch
from torch import nn



def compile_blocks(model: nn.Module, pattern: str, *, backend: str = "inductor", required: bool = True) -> list[str]:
    """Compile the forward of every module whose full name matches `pattern`; returns their names.
    required: a pattern that matches nothing is an error (a pipeline stage may hold no block)."""
    compiled = []
    for name, module in model.named_modules():
        if name and re.fullmatch(pattern, name) and not getattr(module, "_paratrain_compiled", False):
            module.forward = torch.compile(module.forward, backend=backend)  # type: ignore[method-assign]
            module._paratrain_compiled = True  # type: ignore[assignment]
            compiled.append(name)
    if not compiled and required:
        raise ValueError(f"compile pattern {pattern!r} matched no module of {type(model).__name__}")
    return compiled
