"""Lightning-style strategy names ('ddp', 'zero2', 'fsdp', 'tp', '3d') as paratrain ParallelConfigs."""

from __future__ import annotations

from paratrain.config import ConfigError, ParallelConfig

STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "tp": None, "3d": None}
"""Strategy names and their ZeRO stage (tp and 3d: tensor and pipeline degrees from tp= and pp=)."""


def strategy_config(strategy: str | ParallelConfig, *, devices: int, tp: int | None, pp: int | None) -> ParallelConfig:
    """The ParallelConfig of a Lightning-style strategy name (or the given ParallelConfig)."""
    if isinstance(strategy, ParallelConfig):
        if tp is not None or pp is not None:
            raise ConfigError("tp= and pp= go with strategy='tp' or '3d'; a ParallelConfig carries its own degrees")
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}, or a paratrain.ParallelConfig")
    if strategy == "tp":
        if pp is not None:
            raise ConfigError("strategy='tp' splits layers over tp ranks; pp= needs strategy='3d'")
        return ParallelConfig(tp=tp or devices)  # by default every device of a node; dp across nodes
    if strategy == "3d":
        if tp is None or pp is None:
            raise ConfigError(f"strategy='3d' needs the tensor and pipeline degrees: give tp= and pp= (tp={tp}, "
                              f"pp={pp}); dp is what the devices leave")
        return ParallelConfig(tp=tp, pp=pp)
    if tp is not None or pp is not None:
        raise ConfigError(f"strategy={strategy!r} is data parallel; tp= and pp= need strategy='tp' or '3d'")
    return ParallelConfig(zero=STRATEGIES[strategy] or 0)
