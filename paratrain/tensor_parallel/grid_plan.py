"""Apply 2D tensor parallelism by the same plan of module names as 1D (paratrain.tensor_parallel.plan).

    layout = apply_grid_tensor_parallel(model, plan, Grid.of(mesh))

On the grid every linear is the same SUMMA product, so the 1D styles map to grid layers by what the module is:

    column, row          nn.Linear      -> GridLinear
    embedding            nn.Embedding   -> GridEmbedding (the batch is split here)
    norm                 RMSNorm, nn.RMSNorm, nn.LayerNorm -> GridNorm (1d keeps it replicated)
    vocab_output         VocabOutput    -> GridOutput
    heads_dropout        KeyedDropout over [B, H, S, S]: rows split by i, heads by j
    sequence_dropout     KeyedDropout over [B, S, D]:    rows split by i, width by j

Every activation between the embedding and the loss is a block [B_i, S, h_j], so a module with parameters that
the plan leaves out would compute on blocks as if they were whole: the plan must name every one, or it is
refused before anything runs (1d leaves such modules replicated; here there is no replicated activation for them).
Styles with no grid meaning (column_gather, head_partial, the Conv1D styles) are refused with the rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from paratrain.comm.placement import Placements
from paratrain.comm.regions import all_gather_along
from paratrain.models.norms import RMSNorm
from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.loss import VocabOutput
from paratrain.state_layout import ModelState, OptimizerState, per_element
from paratrain.tensor_parallel.grid import Grid
from paratrain.tensor_parallel.grid_layers import GridEmbedding, GridLinear, GridNorm, GridOutput
from paratrain.tensor_parallel.plan import check_ties, resolve_plan
from paratrain.topology.mesh import Mesh

NORMS = (RMSNorm, nn.RMSNorm, nn.LayerNorm)
"""The norms GridNorm splits."""


@dataclass
class GridLayout:
    """What apply_grid_tensor_parallel did (a paratrain.state_layout.StateLayout): matrices cut in q x q blocks
    over the whole grid, vectors (biases, norm weights) cut along the row and copied down the column."""

    grid: Grid
    matrices: dict[str, int] = field(default_factory=dict)
    """Name -> 2 of each matrix cut two ways (output rows by i, input columns by j)."""
    vectors: dict[str, int] = field(default_factory=dict)
    """Name -> 1 of each vector cut along the row (by j)."""
    matrix_ids: frozenset[int] = frozenset()
    vector_ids: frozenset[int] = frozenset()

    @property
    def splits(self) -> dict[str, tuple[tuple[int, int, int], ...]]:
        q, i, j = self.grid.q, self.grid.i, self.grid.j
        return {**{name: ((0, i, q), (1, j, q)) for name in self.matrices},
                **{name: ((0, j, q),) for name in self.vectors}}

    @property
    def tied(self) -> dict[str, str]:
        return {}

    def place(self, placements: Placements, mesh: Mesh) -> None:
        """Matrix blocks: one rank each (per stacked grid: 2.5d counts and saves grid 0's), their norm's squares
        added over the grid. Vectors: a block per column, its gradient already summed down the column and over
        depth (in the layer's backward), counted and saved once."""
        depth = (self.grid.depth,) if self.grid.depth is not None else ()
        placements.add(dataclasses.replace(placements.default.split_over(self.grid.tp), copies=depth,
                                           counted=self.grid.k == 0), self.matrix_ids)
        placements.add(dataclasses.replace(placements.default.split_over(self.grid.row), copies=self.grid.copies),
                       self.vector_ids)

    def register_grad_hooks(self, model: nn.Module, *, split: frozenset[int] = frozenset()) -> None:
        """Nothing to hook: each grid layer's backward sums what the grid splits (the engine calls this for 1d)."""

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]:
        return {name: self.full(name, model[name]) for name in sorted(model)}, per_element(optimizer, self.full)

    def full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this rank's block (collective over the grid's rows and columns)."""
        if name in self.matrices:
            return all_gather_along(all_gather_along(tensor.detach(), self.grid.row, 1), self.grid.col, 0)
        if name in self.vectors:
            return all_gather_along(tensor.detach(), self.grid.row, 0)
        return tensor


def apply_grid_tensor_parallel(model: nn.Module, plan: Mapping[str, str], grid: Grid, *,
                               allow_missing: bool = False) -> GridLayout:
    """Replace the planned modules of `model` in place by their grid versions; see the module's docstring."""
    check_ties(model, plan, allow_missing=allow_missing)
    resolved = resolve_plan(model, plan, allow_missing=allow_missing)
    _check_covered(model, resolved)
    sliced: dict[int, nn.Parameter] = {}  # id(whole parameter) -> its block here: a tie stays one parameter
    kinds: dict[int, int] = {}  # id(block) -> 2 (a matrix) or 1 (a vector)
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if style in ("heads_dropout", "sequence_dropout"):
            if not isinstance(module, KeyedDropout):
                raise TypeError(f"tensor-parallel style {style!r} applies to KeyedDropout, but {name!r} is a "
                                f"{type(module).__name__}: change the plan entry for it")
            module.split_along(0, grid.row_block, grid.row_parts)  # the micro-batch's rows
            module.split_along(1 if style == "heads_dropout" else 2, grid.j, grid.q)
            continue
        replacement = _build(module, name, style, grid)
        for attr, param in replacement.named_parameters(recurse=False):
            full = getattr(module, attr)
            shared = sliced.get(id(full))
            if shared is not None:
                setattr(replacement, attr, shared)
                continue
            sliced[id(full)] = param
            kinds[id(param)] = param.dim()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    layout = GridLayout(grid)
    for pname, param in model.named_parameters():
        if id(param) in kinds:
            (layout.matrices if kinds[id(param)] == 2 else layout.vectors)[pname] = kinds[id(param)]
    layout.matrix_ids = frozenset(k for k, d in kinds.items() if d == 2)
    layout.vector_ids = frozenset(k for k, d in kinds.items() if d == 1)
    return layout


def _check_covered(model: nn.Module, resolved: Mapping[str, str]) -> None:
    """Every parameter belongs to a planned module (see the module's docstring)."""
    planned = tuple(f"{name}." for name in resolved)
    left = [name for name, _ in model.named_parameters() if not name.startswith(planned)]
    if left:
        raise ValueError(f"tp_mode 2d splits every activation into [rows_i, width_j] blocks, and the plan leaves out "
                         f"the parameters {left[:4]}{' ...' if len(left) > 4 else ''}: their modules would compute on "
                         "blocks as if they were whole. Give each a style (column / row for a Linear, embedding, "
                         "norm for RMSNorm / LayerNorm), or use tp_mode 1d")


def _build(module: nn.Module, name: str, style: str, grid: Grid) -> nn.Module:
    if style in ("column", "row") and type(module) is nn.Linear:
        return GridLinear(module, grid)
    if style == "embedding" and isinstance(module, nn.Embedding):
        if module.max_norm is not None:
            raise ValueError(f"{name}: the 2d embedding does not support max_norm (it renormalises rows other ranks "
                             "hold); use tp_mode 1d")
        return GridEmbedding(module, grid)
    if style == "norm" and isinstance(module, NORMS):
        if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
            raise ValueError(f"{name}: the 2d norm normalises over the last dim only, and {name} over "
                             f"{tuple(module.normalized_shape)}; use tp_mode 1d")
        if getattr(module, "weight", None) is None:
            raise ValueError(f"{name}: the 2d norm needs an elementwise weight (elementwise_affine=True)")
        return GridNorm(module, grid)
    if style == "vocab_output" and isinstance(module, VocabOutput):
        return GridOutput(module.vocab_size, grid)
    kinds = {"column": "nn.Linear", "row": "nn.Linear", "embedding": "nn.Embedding",
             "norm": "RMSNorm or nn.LayerNorm", "vocab_output": "VocabOutput"}
    if style in kinds:
        raise TypeError(f"tensor-parallel style {style!r} under tp_mode 2d applies to {kinds[style]}, but {name!r} is "
                        f"a {type(module).__name__}: change the plan entry for it, or use tp_mode 1d")
    raise ValueError(f"tensor-parallel style {style!r} ({name}) has no 2d form: the grid has no replicated "
                     "activation to gather into or to keep a partial module on; use tp_mode 1d")
