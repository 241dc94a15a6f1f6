"""SageMaker model parallelism's configuration keys, read as paratrain settings.

A user of SageMaker's model-parallel library (SMP v1 `smdistributed.modelparallel`, and SMP v2's
`torch.sagemaker` keys) describes a layout with the dict passed to the estimator as
`distribution={"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}}}`.
paratrain takes that `parameters` dict (or the whole `distribution` dict) as the `[smp]` table of a
TOML config or as `paratrain train --smp JSON` (inline, or a path to a JSON file), maps every key it
can honour onto its own settings, and refuses every other key by name, with the reason and what to
use instead: nothing is ignored silently. Explicit paratrain flags win over the mapped keys.

    SMP key                           paratrain setting
    pipeline_parallel_degree          parallel.pp       (SMP v1's older name: partitions)
    tensor_parallel_degree            parallel.tp
    context_parallel_degree (v2)      parallel.cp       (each sequence split over cp ranks; ring attention)
    expert_parallel_degree (v2)       parallel.ep       (each MoE layer's experts divided over ep dp ranks)
    microbatches                      parallel.microbatches (micro-batches per step and dp rank)
    pipeline "simple" / "interleaved" parallel.schedule gpipe / 1f1b (SMP's "interleaved" alternates
                                      forward and backward passes: that is 1F1B, not virtual stages)
    optimize "memory" / "speed"       parallel.sequence_parallel true / false (SMP's memory mode splits
                                      the layer norms and keeps no activation twice over tp)
    ddp true / false                  data parallelism over the remaining ranks / parallel.dp 1
    shard_optimizer_state true        parallel.zero 1
    sharded_data_parallel_degree N    parallel.zero 3 over shard groups of N ranks (N = dp: all of dp)
    hybrid_shard_degree N (v2)        the same; 0: no sharding
    offload_activations,
    sm_activation_offloading (v2)     parallel.offload "activations"
    activation_checkpointing          train.recompute "full" (SMP sets it in code; paratrain reads the key)
    fp16 / bf16 / fp16_params         train.precision fp16 / bf16 / fp16
    random_seed (v2)                  seed
    placement_strategy "PDT"          accepted: paratrain's rank order (tp innermost, then cp, dp, pp)
    auto_partition true,
    delayed_parameter_initialization true, skip_tracing true
                                      accepted: what paratrain always does (balanced stages by cost; the
                                      model built on the meta device, nothing traced)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.config.errors import ConfigError

_REFUSED = {
    "placement_strategy": "paratrain places ranks tp innermost, then dp, then pp ('PDT'); only 'PDT' is accepted",
    "default_partition": "paratrain cuts pipeline stages by cost or by --pp-split, not by a default partition",
    "memory_weight": "paratrain balances pipeline stages by compute cost; give --pp-split to cut them yourself",
    "active_microbatches": "the pipeline schedule decides how many micro-batches are in flight (1F1B: at most pp)",
    "prescaled_batch": "paratrain feeds every tp rank the same batch rows already",
    "activation_loading_horizon": "paratrain's activation offload fetches each activation when backward needs it",
    "horovod": "paratrain's data parallelism is its own (torch.distributed), not Horovod",
    "contiguous": "a TensorFlow partitioning option",
    "fsdp_cache_flush_warnings": "a PyTorch FSDP option; paratrain's ZeRO-3 is its own",
    "allow_empty_shards": "paratrain pads every flat group to a multiple of the shard group: no shard is empty",
    "deterministic_server": "paratrain's pipeline runs one fixed program per rank already",
    "ddp_port": "set the rendezvous with --rdzv-endpoint",
    "ddp_dist_backend": "the backend follows --device (gloo on the CPU, NCCL on CUDA)",
}


def read_smp(text_or_path: str) -> dict[str, Any]:
    """The SMP dict of `--smp`: inline JSON, or the path of a JSON file."""
    text = text_or_path.strip()
    if not text.startswith("{"):
        try:
            text = Path(text_or_path).read_text()
        except OSError as error:
            raise ConfigError(f"--smp {text_or_path!r} is neither a JSON object nor a readable JSON file: "
                              f"{error}") from None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"--smp is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--smp must be a JSON object of SageMaker model-parallel keys, got {type(value).__name__}")
    return value


def smp_overrides(table: Mapping[str, Any]) -> dict[str, Any]:
    """paratrain's dotted settings for SMP's keys (the estimator's `parameters`, or the whole
    `distribution` dict); ConfigError naming any key paratrain cannot honour."""
    params = _parameters(table)
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _REFUSED and not (key == "placement_strategy" and value == "PDT"):
            raise ConfigError(f"SageMaker model-parallel key {key!r} ({value!r}) is not supported: {_REFUSED[key]}")
        if key in ("pipeline_parallel_degree", "partitions"):
            out["parallel.pp"] = _int(key, value, low=1)
        elif key == "tensor_parallel_degree":
            out["parallel.tp"] = _int(key, value, low=1)
        elif key == "context_parallel_degree":
            out["parallel.cp"] = _int(key, value, low=1)
        elif key == "expert_parallel_degree":
            out["parallel.ep"] = _int(key, value, low=1)
        elif key == "microbatches":
            out["parallel.microbatches"] = _int(key, value, low=1)
        elif key == "pipeline":
            out["parallel.schedule"] = _choice(key, value, {"simple": "gpipe", "interleaved": "1f1b"})
        elif key == "optimize":
            out["parallel.sequence_parallel"] = _choice(key, value, {"memory": True, "speed": False})
        elif key == "ddp":
            if not _bool(key, value):
                out["parallel.dp"] = 1
        elif key == "shard_optimizer_state":
            if _bool(key, value):
                out.setdefault("parallel.zero", 1)
        elif key in ("sharded_data_parallel_degree", "hybrid_shard_degree"):
            degree = _int(key, value, low=0)
            if degree > 1:
                out["parallel.zero"] = 3
                out["parallel.shard_group"] = degree
        elif key in ("offload_activations", "sm_activation_offloading"):
            if _bool(key, value):
                out["parallel.offload"] = "activations"
        elif key == "activation_checkpointing":
            out["train.recompute"] = "full" if _bool(key, value) else "none"
        elif key in ("fp16", "bf16", "fp16_params"):
            if _bool(key, value):
                precision = "bf16" if key == "bf16" else "fp16"
                if out.get("train.precision", precision) != precision:
                    raise ConfigError("SageMaker model-parallel keys ask for both fp16 and bf16: keep one")
                out["train.precision"] = precision
        elif key == "random_seed":
            out["seed"] = _int(key, value, low=0)
        elif key in ("auto_partition", "delayed_parameter_initialization", "skip_tracing"):
            if not _bool(key, value):
                raise ConfigError(f"SageMaker model-parallel key {key!r} false is not supported: paratrain always "
                                  "balances stages itself (or by --pp-split), builds on the meta device and traces "
                                  "nothing; drop the key")
        elif key != "placement_strategy":
            raise ConfigError(f"unknown SageMaker model-parallel key {key!r}: paratrain maps "
                              f"{', '.join(sorted(_KNOWN))} (docs/sagemaker.md)")
    return out


_KNOWN = {"pipeline_parallel_degree", "partitions", "tensor_parallel_degree", "context_parallel_degree",
          "expert_parallel_degree", "microbatches", "pipeline", "optimize",
          "ddp", "shard_optimizer_state", "sharded_data_parallel_degree", "hybrid_shard_degree",
          "offload_activations", "sm_activation_offloading", "activation_checkpointing", "fp16", "bf16", "fp16_params",
          "random_seed", "placement_strategy", "auto_partition", "delayed_parameter_initialization", "skip_tracing"}


def _parameters(table: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `parameters` of SMP's options, from them directly or from the estimator's `distribution`."""
    if "smdistributed" in table:
        table = table["smdistributed"].get("modelparallel", {})
    if "parameters" in table:
        if table.get("enabled") is False:
            raise ConfigError("the SageMaker model-parallel options say enabled: false; drop them, or enable them")
        table = table["parameters"]
    if not isinstance(table, Mapping):
        raise ConfigError(f"SageMaker model-parallel parameters must be a table of keys, got {type(table).__name__}")
    return table


def _int(key: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"SageMaker model-parallel key {key!r} must be an integer >= {low}, got {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"SageMaker model-parallel key {key!r} must be true or false, got {value!r}")
    return value


def _choice(key: str, value: Any, choices: Mapping[str, Any]) -> Any:
    if value not in choices:
        raise ConfigError(f"SageMaker model-parallel key {key!r} must be one of {', '.join(map(repr, choices))}, "
                          f"got {value!r}")
    return choices[value]
