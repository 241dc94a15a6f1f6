"""Typed configuration: dataclasses, TOML loading with overrides, and the rules a run must obey."""

from paratrain.config.errors import ConfigError
from paratrain.config.load import build_run_config, from_dict, load_toml, to_dict
from paratrain.config.model import PRESETS, ModelConfig, preset
from paratrain.config.parallel import SCHEDULES, ParallelConfig
from paratrain.config.plan import BatchLayout, RunPlan, batch_layout, read_run, write_run
from paratrain.config.run import (
    DataSection,
    LaunchSection,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainSection,
)
from paratrain.config.validate import check_run
from paratrain.config.world import DEVICES, launch_world_size, resolve_device

__all__ = [
    "DEVICES", "PRESETS", "BatchLayout", "ConfigError", "DataSection", "LaunchSection", "ModelConfig",
    "ModelSection", "OptimSection", "ParallelConfig", "SCHEDULES", "RunConfig", "RunPlan", "TrainSection",
    "batch_layout", "build_run_config", "check_run", "launch_world_size", "from_dict", "load_toml", "preset",
    "read_run", "resolve_device", "to_dict", "write_run",
]
