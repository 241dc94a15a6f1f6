"""paratrain: distributed training strategies as explicit, composable code on torch.distributed.

    ctx = paratrain.init(paratrain.ParallelConfig(dp=2))
    engine = paratrain.parallelize(model, ctx, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    loss = engine.train_step(batch, loss_fn)     # this rank's share of the global batch
    state = engine.state_dict()                  # full, layout-free
"""

from paratrain.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from paratrain.hybrid import Engine, parallelize
from paratrain.models import GPT, build_gpt, lm_loss
from paratrain.topology import Context, init

__version__ = "0.1.0"

__all__ = [
    "GPT", "ConfigError", "Context", "Engine", "ModelConfig", "ParallelConfig", "RunConfig",
    "build_gpt", "init", "lm_loss", "parallelize",
]
