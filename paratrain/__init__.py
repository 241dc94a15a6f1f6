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

from paratrain.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from paratrain.fit import Callback, FitResult, Trainer
from paratrain.hybrid import Engine, EngineOptions, parallelize
from paratrain.memory import Float8Settings
from paratrain.models import GPT, build_gpt, lm_loss
from paratrain.nn.recipe import Recipe, recipe_for
from paratrain.topology import Context, init
from paratrain.train.serve import ServeResult, serve

__version__ = "0.1.0"

__all__ = [
    "GPT", "Callback", "ConfigError", "Context", "Engine", "EngineOptions", "FitResult", "Float8Settings", "ModelConfig",
    "ParallelConfig", "Recipe", "RunConfig", "ServeResult", "Trainer", "build_gpt", "init", "lm_loss", "parallelize",
    "recipe_for", "serve",
]
