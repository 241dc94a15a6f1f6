"""paratrain: distributed training strategies as explicit, composable code on torch.distributed.

    ctx = paratrain.init(paratrain.ParallelConfig(dp=2))
    engine = paratrain.parallelize(model, ctx, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=4))
    loss = engine.train_step(batch, loss_fn)     # this rank's share of the global batch
    state = engine.state_dict()                  # full, layout-free

with the parameter server (ParallelConfig(ps_mode="sync", ps_servers=2)) the server ranks run
paratrain.serve(model, ctx, optimizer=...) instead, and the trainers end with engine.close();

or, in the shape Lightning users know (paratrain.fit):

    paratrain.Trainer(devices=4, strategy="zero2", max_steps=100, global_batch=32).fit(model, loss_fn, dataset)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
    from paratrain.fit import Callback, FitResult, Trainer
    from paratrain.hybrid import Engine, EngineOptions, parallelize
    from paratrain.memory import Float8Settings
    from paratrain.models import GPT, build_gpt, lm_loss
    from paratrain.nn.recipe import Recipe, recipe_for
    from paratrain.topology import Context, init
    from paratrain.train.serve import ServeResult, serve

_EXPORTS = {
    "ConfigError": "paratrain.config", "ModelConfig": "paratrain.config", "ParallelConfig": "paratrain.config",
    "RunConfig": "paratrain.config", "Callback": "paratrain.fit", "FitResult": "paratrain.fit",
    "Trainer": "paratrain.fit", "Engine": "paratrain.hybrid", "EngineOptions": "paratrain.hybrid",
    "parallelize": "paratrain.hybrid", "Float8Settings": "paratrain.memory", "GPT": "paratrain.models",
    "build_gpt": "paratrain.models", "lm_loss": "paratrain.models", "Recipe": "paratrain.nn.recipe",
    "recipe_for": "paratrain.nn.recipe", "Context": "paratrain.topology", "init": "paratrain.topology",
    "ServeResult": "paratrain.train.serve", "serve": "paratrain.train.serve",
}
"""Each public name and the module that defines it, imported when first used (PEP 562): `paratrain plan` and the
CLI's --help then load the planner or the parser only, not the engine, the trainers and their torch modules."""


def __getattr__(name: str) -> Any:
    """A public name (_EXPORTS) or a subpackage (`paratrain.fit.Callback` after `import paratrain`), imported now."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":  # a module it imports is missing: say that one
                raise
            raise AttributeError(f"module 'paratrain' has no attribute {name!r}") from None
    globals()[name] = value  # the next access is a plain global
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "GPT", "Callback", "ConfigError", "Context", "Engine", "EngineOptions", "FitResult", "Float8Settings", "ModelConfig",
    "ParallelConfig", "Recipe", "RunConfig", "ServeResult", "Trainer", "build_gpt", "init", "lm_loss", "parallelize",
    "recipe_for", "serve",
]
