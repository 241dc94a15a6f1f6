"""The balanced split of a pipeline's layers into chunks, by their costs: pure Python (no torch), so that the planner
prices the very cut the engine makes (paratrain.pipeline.stages) without importing the engine."""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.config.errors import ConfigError


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Start index of each of `parts` contiguous, non-empty ranges minimising the largest range cost
    (exact, by dynamic programming over split points). The cut of the p x v chunks: paratrain.pipeline.stages cuts
    a model's layers by it, and the planner its layer costs."""
    n = len(costs)
    if parts > n:
        raise ConfigError(f"{parts} pipeline chunks need at least {parts} layers; the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][j]: first j layers in k ranges
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]
