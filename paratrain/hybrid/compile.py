"""torch.compile per transformer block, applied from outside by module name (as torchtitan does).

Each matching module is compiled in place by torch's own `nn.Module.compile` (its call, hooks
included, becomes a compiled function; the module object, its class and its forward are untouched),
after tensor parallelism and recomputation have changed it and before activation offload hooks it,
so that:
  - parameter names, and with them checkpoints, TP plans and ZeRO's units, stay the model's own;
  - a recomputed block (paratrain.memory.recompute's wrapper) is compiled with its checkpoint
    inside (inductor then decides what to keep);
  - offloaded activations are what the compiled graph saves (offload's hooks run eagerly around it);
  - every block of one model shares one compiled graph (same code, same shapes): one compilation.
What is not compiled, and why:
  - collectives (paratrain.comm.regions, the sequence-parallel linear) and offload's hooks:
    paratrain.eager marks them, so dynamo breaks the graph there and they run eagerly, in the order
    every rank agrees on; ZeRO-3's gather hooks, traced with the block's call, break it likewise;
  - keyed dropout with p > 0: its key changes every step (a graph per step otherwise);
  - Mixture-of-Experts layers (paratrain.nn.moe, marked eager): routing makes shapes that depend on the
    data, and under expert parallelism their all-to-alls are collectives; the block's attention, norms
    and residual adds around them are compiled;
  - the embedding, the final norm, the head and the loss: outside the blocks (the chunked loss is
    a Python loop over row chunks; the head is one matmul).
"""

from __future__ import annotations

import re

from torch import nn


def compile_blocks(model: nn.Module, pattern: str, *, backend: str = "inductor", required: bool = True) -> list[str]:
    """Compile every module whose full name matches `pattern` (nn.Module.compile: compiling one again
    replaces its compiled call); returns their names. required: a pattern that matches nothing is an
    error (a pipeline stage may hold no block)."""
    compiled = []
    for name, module in model.named_modules():
        if name and re.fullmatch(pattern, name):
            module.compile(backend=backend)
            compiled.append(name)
    if not compiled and required:
        raise ValueError(f"compile pattern {pattern!r} matched no module of {type(model).__name__}")
    return compiled
