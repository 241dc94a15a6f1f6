"""The loggers users already use: Weights & Biases and MLflow, beside the JSON lines and TensorBoard.

    paratrain train ... --logger jsonl,tensorboard,wandb,mlflow --log-dir runs/a

One flag names the loggers; --log-dir is where each writes unless told otherwise: jsonl to DIR/log.jsonl (or
--log-json), tensorboard to DIR/tensorboard (or --tensorboard), wandb a run under DIR (offline unless WANDB_MODE
says otherwise: nothing leaves the machine by default; `wandb sync` uploads it), mlflow a run in the tracking store
MLFLOW_TRACKING_URI names, else sqlite:///DIR/mlflow.db. Rank 0 writes, every logger the same scalars under the same
names (paratrain.train.tensorboard.TAGS: train/loss, train/lr, train/grad_norm, val/loss, perf/...) at the optimizer
step, and the run's config once (W&B's config; MLflow's params, flattened). `pip install 'paratrain[loggers]'`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from paratrain.config.errors import ConfigError
from paratrain.train.tensorboard import TAGS


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A step record's scalars under the loggers' names (memory/<part>_mib from the first step's memory record)."""
    out = {tag: float(record[key]) for key, tag in TAGS.items() if record.get(key) is not None}
    out.update({f"memory/{part}_mib": nbytes / 2**20 for part, nbytes in record.get("memory", {}).items()})
    return out


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


class WandbLog:
    def __init__(self, folder: str, config: Mapping[str, Any], *, name: str = "") -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("--logger wandb: the wandb package is not installed: pip install 'paratrain[loggers]' "
                              "(or wandb)") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE", "offline")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "paratrain"), dir=folder, mode=mode,
                               config=dict(config), name=name or None, reinit="finish_previous")

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self._run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class MlflowLog:
    def __init__(self, folder: str, config: Mapping[str, Any], *, name: str = "") -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("--logger mlflow: the mlflow package is not installed: pip install 'paratrain[loggers]' "
                              "(mlflow-skinny with sqlalchemy and alembic, or mlflow)") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(folder).resolve() / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        self._run = mlflow.start_run(run_name=name or None)
        params = _flat(config)
        if params:
            mlflow.log_params(params)

    def write(self, record: dict[str, Any]) -> None:
        values = {key.replace("/", "."): value for key, value in scalars(record).items()}
        if values:
            self._mlflow.log_metrics(values, step=int(record["step"]))

    def close(self) -> None:
        self._mlflow.end_run()
