"""Learning rate by step: linear warmup, then cosine, warmup-stable-decay, linear or constant. Stateless: lr is a
function of the step, so a resumed run continues the same curve."""

from __future__ import annotations

import math


def lr_at(step: int, *, total_steps: int, peak: float, warmup_steps: int, min_ratio: float,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warmup: peak * (step + 1) / warmup_steps for the first warmup_steps steps; then down to peak * min_ratio,
    reached at the last step:
        cosine    a half cosine (Loshchilov & Hutter 2017, SGDR)
        linear    a straight line
        wsd       warmup-stable-decay (MiniCPM, Hu et al. 2024; DeepSeek): peak until the last
                  round(decay_fraction * total_steps) steps, then a straight line down
        constant  peak throughout
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    floor = peak * min_ratio
    if schedule == "constant":
        return peak
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        start = total_steps - decay_steps
        if step < start:
            return peak
        return peak + (floor - peak) * min(1.0, (step - start + 1) / decay_steps)
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return peak + (floor - peak) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
