"""The settings a layout is made of, declared once: where a run keeps each and how the planner names it.

A layout is the degree of every axis (dp, tp and its grid mode, pp and its schedule, cp, ep, the parameter
server's servers) and the memory savers (ZeRO and its shard groups, offload, recomputation, sequence
parallelism, the micro-batch). The planner's `Layout` (paratrain.planner.layout) holds them as flat fields; a
run keeps them in RunConfig's sections. Each is declared here once, with its planner field name, its path in
RunConfig (also its TOML key: `[parallel] tp_mode`), and the conversion between the two where they differ;
`paratrain train --plan auto` hands the whole chosen layout to the run through `apply_layout`, reads the
flags given as pins through `layout_of`, and the search checks a candidate by the run's own rules on the
ParallelConfig `parallel_config` builds. A field the planner adds without a declaration here fails
tests/unit/test_layout_settings.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from paratrain.config.parallel import ParallelConfig
from paratrain.config.run import RunConfig


def _same(value: Any, current: Any = None) -> Any:
    return value


@dataclass(frozen=True)
class LayoutSetting:
    name: str
    """The planner's Layout field (Layout.to_dict's key, paratrain.planner.layout.LAYOUT_FIELDS)."""
    path: str
    """Where RunConfig keeps it, section.attribute: its TOML key, and the config path its flag sets."""
    to_config: Callable[[Any, Any], Any] = _same
    """(the planner's value, the run's current one) -> the run's."""
    from_config: Callable[[Any], Any] = _same
    """The run's value -> the planner's."""


def _offload_to_config(offloaded: bool, current: str) -> str:
    """The planner's offload is the optimizer's; activation offload, a run's choice, is kept as it was."""
    parts = ({"optimizer"} if offloaded else set()) | (_offload_parts(current) & {"activations"})
    return ",".join(p for p in ("optimizer", "activations") if p in parts) or "none"


def _offload_parts(offload: str) -> set[str]:
    return {part.strip() for part in offload.split(",")} - {"none", ""}


def _offload_from_config(offload: str) -> bool:
    return "optimizer" in _offload_parts(offload)


LAYOUT_SETTINGS: tuple[LayoutSetting, ...] = (
    LayoutSetting("dp", "parallel.dp"),
    LayoutSetting("tp", "parallel.tp"),
    LayoutSetting("tp_mode", "parallel.tp_mode"),
    LayoutSetting("tp_depth", "parallel.tp_depth"),
    LayoutSetting("pp", "parallel.pp"),
    LayoutSetting("virtual_stages", "parallel.virtual_stages"),
    LayoutSetting("schedule", "parallel.schedule"),
    LayoutSetting("cp", "parallel.cp"),
    LayoutSetting("cp_mode", "parallel.cp_mode"),
    LayoutSetting("cp_ulysses", "parallel.cp_ulysses"),
    LayoutSetting("ep", "parallel.ep"),
    LayoutSetting("expert_tp", "parallel.expert_tp"),
    LayoutSetting("zero", "parallel.zero"),
    LayoutSetting("shard_group", "parallel.shard_group"),
    LayoutSetting("offload", "parallel.offload", _offload_to_config, _offload_from_config),
    LayoutSetting("ps_mode", "parallel.ps_mode"),
    LayoutSetting("ps_servers", "parallel.ps_servers"),
    LayoutSetting("staleness", "parallel.staleness"),
    LayoutSetting("sequence_parallel", "parallel.sequence_parallel"),
    LayoutSetting("micro_batch", "data.micro_batch"),
    LayoutSetting("recompute", "train.recompute"),
)
"""Every setting of a layout, in the order a plan describes them."""

_PARALLEL = tuple((s.name, s.path.split(".")[1], s.to_config) for s in LAYOUT_SETTINGS if s.path.startswith("parallel."))


def parallel_config(fields: Mapping[str, Any]) -> ParallelConfig:
    """The ParallelConfig of a layout's fields (planner names; the parallel section's settings only, the others
    at their defaults): what the planner's search checks with the run's own rules, once per candidate."""
    default = ParallelConfig()
    return ParallelConfig(**{attribute: to_config(fields[name], getattr(default, attribute))
                             for name, attribute, to_config in _PARALLEL if name in fields})


def apply_layout(config: RunConfig, fields: Mapping[str, Any]) -> RunConfig:
    """`config` with every layout field of `fields` (planner names, Layout.to_dict's) set where the run keeps it;
    the other settings as they were. Unknown names are refused."""
    by_name = {setting.name: setting for setting in LAYOUT_SETTINGS}
    unknown = sorted(set(fields) - set(by_name))
    if unknown:
        raise ValueError(f"layout fields {unknown} have no LayoutSetting (paratrain.config.layout): declare them")
    sections: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        setting = by_name[name]
        section, attribute = setting.path.split(".")
        current = getattr(getattr(config, section), attribute)
        sections.setdefault(section, {})[attribute] = setting.to_config(value, current)
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)
                                          for section, changes in sections.items()})


def layout_of(config: RunConfig, paths: set[str] | None = None) -> dict[str, Any]:
    """The planner's names and values of the layout settings `config` holds (only those at `paths`, if given)."""
    out = {}
    for setting in LAYOUT_SETTINGS:
        if paths is None or setting.path in paths:
            section, attribute = setting.path.split(".")
            out[setting.name] = setting.from_config(getattr(getattr(config, section), attribute))
    return out
