"""RunConfig from a TOML file and dotted overrides ("data.global_batch=64"), and back to plain dicts."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Mapping

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig
from paratrain.config.run import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def build_run_config(table: Mapping[str, Any] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults, then a TOML-shaped table (its [smp] table of SageMaker model-parallel keys first:
    paratrain.config.sagemaker), then dotted overrides; unknown keys are errors."""
    config = RunConfig()
    table = dict(table or {})
    if "smp" in table:
        from paratrain.config.sagemaker import smp_overrides

        smp = table.pop("smp")
        if not isinstance(smp, Mapping):
            raise ConfigError("[smp] must be a table of SageMaker model-parallel keys")
        for path, item in smp_overrides(smp).items():
            config = _set(config, path, item)
    for section, value in table.items():
        if isinstance(value, Mapping) and section != "model":
            for key, item in value.items():
                config = _set(config, f"{section}.{key}", item)
        elif section == "model" and isinstance(value, Mapping):
            for key, item in value.items():
                path = f"model.{key}" if key in ("preset", "hf") else f"model.overrides.{key}"
                config = _set(config, path, item)
        else:
            config = _set(config, section, value)
    for path, value in (overrides or {}).items():
        config = _set(config, path, value)
    return config


def to_dict(config: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def from_dict(table: Mapping[str, Any]) -> RunConfig:
    """Inverse of to_dict (model overrides are stored under model.overrides)."""
    flat = dict(table)
    model = dict(flat.pop("model", {}))
    result = build_run_config(flat)
    result.model.preset = model.get("preset", result.model.preset)
    result.model.overrides = dict(model.get("overrides", {}))
    result.model.hf = str(model.get("hf", result.model.hf))
    return result


def _set(config: RunConfig, path: str, value: Any) -> RunConfig:
    parts = path.split(".")
    if parts[:2] == ["model", "overrides"] and len(parts) == 3:
        if parts[2] in {f.name for f in dataclasses.fields(ModelConfig)}:  # unknown names: preset() lists them
            _check_field(ModelConfig, parts[2], value, f"model.{parts[2]}")
        config.model.overrides[parts[2]] = value
        return config
    if len(parts) == 1:
        if parts[0] != "seed" and hasattr(config, parts[0]):
            raise ConfigError(f"{path!r} is a section: give it as a table ([{path}] in TOML), not a value")
        _check_field(config, parts[0], value, path)
        setattr(config, parts[0], value)
        return config
    if len(parts) != 2:
        raise ConfigError(f"unknown setting {path!r}: settings are 'section.key', e.g. data.global_batch")
    section_name, key = parts
    if not hasattr(config, section_name) or section_name == "seed":
        sections = [f.name for f in dataclasses.fields(config) if f.name != "seed"]
        raise ConfigError(f"unknown config section {section_name!r}: choose one of {sections}")
    section = getattr(config, section_name)
    if isinstance(value, list):  # TOML arrays: the dataclasses hold tuples
        value = tuple(value)
    _check_field(section, key, value, path)
    if isinstance(section, ParallelConfig):  # frozen: it is also a public API value
        setattr(config, section_name, dataclasses.replace(section, **{key: value}))
    else:
        setattr(section, key, value)
    return config


def _check_field(obj: Any, key: str, value: Any, path: str) -> None:
    """The key exists on obj, and the value has the kind its annotation names (None allowed only
    where the annotation allows it)."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise ConfigError(f"unknown setting {path!r}: {type(obj).__name__} has {sorted(fields)}")
    annotation = str(fields[key].type)
    if value is None:
        if "None" not in annotation:
            raise ConfigError(f"{path} must be set, got None")
        return
    kind = annotation.split("|")[0].strip()
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "bool": isinstance(value, bool),
        "int": is_int,
        "float": is_int or isinstance(value, float),
        "str": isinstance(value, str),
    }.get(kind, True)
    if not ok:
        words = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}
        raise ConfigError(f"{path} must be {words[kind]}, got {value!r}")
