"""Learning rate: linear warmup, then cosine decay to a floor. Stateless: lr is a function of the step."""

from __future__ import annotations

import math


def lr_at(step: int, *, total_steps: int, peak: float, warmup_steps: int, min_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup: peak * (step + 1) / warmup_steps for the first warmup_steps steps; then a half cosine
    from peak down to peak * min_ratio, reached at the last step (Loshchilov & Hutter 2017, SGDR).
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = peak * min_ratio
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
