"""The Hugging Face families context parallelism does not run yet, refused before launch (the run's checks:
paratrain.hf.load.run_model_shape) with the rule and the fix."""

from __future__ import annotations

from typing import Any

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig


def check_hf_family(family: Any, parallel: ParallelConfig) -> None:
    """Refuse cp > 1 where a family's pieces are not split with the sequence. family: the folder's transformers
    config (its model_type and dropouts)."""
    if parallel.cp == 1:
        return
    if family.model_type == "gpt_oss":
        raise ConfigError(f"--cp {parallel.cp} with gpt-oss: its attention sinks (a learned logit a head) are not in "
                          "the ring / Ulysses attentions yet; train it with dp, ZeRO, pp or ep")
    if family.model_type == "gpt2":
        dropouts = {k: getattr(family, k, 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
        if parallel.pp > 1 or any(dropouts.values()):
            why = (f"with --pp {parallel.pp}: a stage's embedding reads its part's positions (not built)" if parallel.pp > 1
                   else f"with dropout {dropouts}: transformers draws it from each rank's own generator")
            raise ConfigError(f"--cp {parallel.cp} on GPT-2 {why}; set the dropouts to 0 in config.json and use pp 1, "
                              "or cp 1")
