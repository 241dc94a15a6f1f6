"""Which linears precision fp8 makes float8, and how (paratrain.memory.float8 is the kernel they multiply with).

    Float8Settings   the recipe, the linears left in bf16, the scaling, the scale log, ZeRO-3's float8 gathers
    float8_linears   the blocks' nn.Linear layers a model has, checked (widths, none found)
    apply_float8     each made a KernelLinear with its Float8Linear kernel, before tensor parallelism slices it
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.config.model_rules import FLOAT8_MULTIPLE
from paratrain.memory.float8 import FLOAT8_RECIPES, SCALINGS, Float8Linear, ScaleLog
from paratrain.nn.kernels import KernelLinear
from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class Float8Settings:
    """Which linears compute in float8 under precision 'fp8', and how (EngineOptions.fp8; the run's [train]
    fp8_recipe / fp8_skip)."""

    recipe: str = "tensorwise"
    """A name in FLOAT8_RECIPES."""
    skip: str = r"(^|\.)gate$"
    """A regex of linear names left in the compute dtype besides what is never float8 (every linear outside the
    recipe's blocks: the head, embeddings' projections; routers, which are not linears here). The default keeps
    the Hugging Face MoE families' routers (`mlp.gate`, `block_sparse_moe.gate`): routing is a discrete choice."""
    scaling: str = "logical"
    """'logical': every scale the logical tensor's; 'shard': this rank's slice's (a debug switch, layout-dependent)."""
    log: ScaleLog | None = None
    """Where to record every scale taken (tests, forensics); None: nowhere."""
    gather: bool = True
    """Under ZeRO-3 with the tensorwise recipe: gather the float8 linears' weights in float8 (half the bytes; the
    same numbers: paratrain.sharding.float8_gather). False: in bf16."""

    @property
    def gathers_float8(self) -> bool:
        """Whether ZeRO-3 gathers the float8 linears' weights in float8: tensorwise only (a rowwise linear casts
        its weight along rows forward and columns backward, which one gathered grid cannot serve)."""
        return self.gather and not FLOAT8_RECIPES[self.recipe].rowwise and self.scaling == "logical"

    def __post_init__(self) -> None:
        if self.recipe not in FLOAT8_RECIPES:
            raise ValueError(f"fp8 recipe must be one of {', '.join(FLOAT8_RECIPES)}, got {self.recipe!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")
        re.compile(self.skip)


def float8_linears(model: nn.Module, blocks: str, settings: Float8Settings, *, parts: int,
                   dense: frozenset[str] = frozenset()) -> list[str]:
    """The linears precision fp8 makes float8: every nn.Linear inside the blocks (module names matching `blocks`)
    that settings.skip and `dense` (what must stay dense: a tp plan's partial_linear, whose output gradient is
    partial on each rank, so no cast of it is the whole gradient's) do not name. Pure (paratrain.Trainer asks it
    before launching); refused where none is found (fp8 would change nothing), and where a dimension would not stay a
    multiple of 16 in each of the `parts` slices tensor parallelism cuts it into (tp under 1d, the grid's side q
    under 2d / 2.5d)."""
    skip, block = re.compile(settings.skip), re.compile(blocks)
    chosen = [(name, module) for name, module in model.named_modules()
              if type(module) is nn.Linear and not skip.search(name) and name not in dense
              and any(block.fullmatch(name[:i]) for i in range(len(name)) if name[i] == ".")]
    if not chosen:
        raise ConfigError(f"precision fp8 found no nn.Linear in the blocks ({blocks!r}) of this {type(model).__name__} "
                          f"but what fp8_skip ({settings.skip!r}) names or must stay dense: it would train in bf16. "
                          "Use precision bf16, or a model whose blocks multiply with nn.Linear")
    unfit = [f"{name} [{m.out_features}, {m.in_features}]" for name, m in chosen
             if m.in_features % (FLOAT8_MULTIPLE * parts) or m.out_features % (FLOAT8_MULTIPLE * parts)]
    if unfit:
        raise ConfigError(f"precision fp8 multiplies in float8 with torch._scaled_mm, which needs every dimension a "
                          f"multiple of {FLOAT8_MULTIPLE} in each of the {parts} slices tensor parallelism cuts it "
                          f"into (so of {FLOAT8_MULTIPLE * parts} whole): {', '.join(unfit[:4])}"
                          f"{' ...' if len(unfit) > 4 else ''}. "
                          "Leave them in bf16 with fp8_skip (a regex of their names), or change the widths")
    return [name for name, _ in chosen]


def apply_float8(model: nn.Module, settings: Float8Settings, tokens: Mapping[str, tuple[AxisGroup, ...]]) -> None:
    """Make the linears `tokens` names (float8_linears' choice) float8 linears (paratrain.nn.kernels.KernelLinear
    with a Float8Linear kernel, the same Parameters), each with the groups that split its tokens; run before tensor
    parallelism, whose layers keep the kernel of the linear they slice."""
    recipe = FLOAT8_RECIPES[settings.recipe]
    for name, groups in tokens.items():
        kernel = Float8Linear(recipe, name, tokens=groups, scaling=settings.scaling, log=settings.log)
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, KernelLinear(model.get_submodule(name), kernel))
