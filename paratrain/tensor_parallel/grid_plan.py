"""Apply 2D / 2.5D / 3D tensor parallelism by the same plan of module names as 1D (paratrain.tensor_parallel.plan).

    layout = apply_grid_tensor_parallel(model, plan, Grid.of(mesh))     # 2d, 2.5d
    layout = apply_grid_tensor_parallel(model, plan, Cube.of(mesh))     # 3d

The 1D styles map to grid (or cube) layers by what the module is:

    column, row          nn.Linear      -> GridLinear (every SUMMA product alike) / CubeLinear (column: stream ->
                                           turned, row: back)
    embedding            nn.Embedding   -> GridEmbedding / CubeEmbedding (the batch's rows are split here)
    column_gather        nn.Linear      -> the column layer, its output gathered whole on every rank (HF's lm_head)
    norm                 RMSNorm, nn.RMSNorm, nn.LayerNorm, HF's plain RMSNorm -> SplitNorm on the stream (1d keeps
                                           it replicated)
    vocab_output         VocabOutput    -> SplitOutput on the head's logits (a column head's layout)
    heads_dropout        KeyedDropout over [B, H, S, S]: rows and heads as a column layer's output
    sequence_dropout     KeyedDropout over [B, S, D]: rows and width as the stream

Every activation between the embedding and the loss is a block, so a module with parameters that the plan leaves
out would compute on blocks as if they were whole: the plan must name every one, or it is refused before anything
runs (1d leaves such modules replicated; here there is no replicated activation for them). Styles with no grid
meaning (head_partial, the Conv1D styles) are refused with the rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from paratrain.comm.placement import Placements
from paratrain.comm.regions import all_gather_along
from paratrain.nn.kernels import KernelLinear
from paratrain.nn.norms import RMSNorm
from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.loss import VocabOutput
from paratrain.state_layout import ModelState, OptimizerState, per_element
from paratrain.tensor_parallel.cube import Cube
from paratrain.tensor_parallel.cube_layers import CubeEmbedding, CubeLinear, cube_matrix
from paratrain.tensor_parallel.grid import Activations, Block, Cut, Grid
from paratrain.tensor_parallel.grid_layers import (GridEmbedding, GridLinear, SplitNorm, SplitOutput, matrix_block,
                                                  vector_block)
from paratrain.tensor_parallel.plan import check_ties, resolve_plan
from paratrain.topology.mesh import Mesh

NORMS = (RMSNorm, nn.RMSNorm, nn.LayerNorm)
"""The norms SplitNorm splits."""


@dataclass
class GridLayout:
    """What apply_grid_tensor_parallel did (a paratrain.state_layout.StateLayout): each parameter's Block."""

    blocks: dict[str, Block] = field(default_factory=dict)
    """Parameter name -> how it is cut, made whole, counted and saved."""
    ids: dict[int, Block] = field(default_factory=dict)
    """The same by id() of the parameter, for the gradient placements."""
    kinds: tuple[Block, ...] = ()
    """A block of every kind the grid makes (a matrix, a vector along each activation layout's width), in one order:
    every rank places each kind, holding parameters of it or not, so every pipeline stage reduces the same parts of
    the gradient norm (a stage of only the embedding has no norm's vector)."""

    @property
    def splits(self) -> dict[str, tuple[Cut, ...]]:
        return {name: block.cuts for name, block in self.blocks.items()}

    @property
    def tied(self) -> dict[str, str]:
        return {}

    def place(self, placements: Placements, mesh: Mesh) -> None:
        """Each block: its norm's squares added over the ranks holding other blocks of it, its gradient already
        summed over its copies (in the layer's backward), counted and saved once."""
        kinds: dict[tuple, list[int]] = {(b.split, b.copies, b.counted): [] for b in self.kinds}
        for key, block in self.ids.items():
            kinds.setdefault((block.split, block.copies, block.counted), []).append(key)
        for (split, copies, counted), ids in kinds.items():
            placements.add(dataclasses.replace(placements.default.split_over(split), copies=copies, counted=counted),
                           ids)

    def register_grad_hooks(self, model: nn.Module, *,
                            split: frozenset[int] = frozenset()) -> list[RemovableHandle]:
        """Nothing to hook: each grid layer's backward sums what the grid splits (the engine calls this for 1d)."""
        return []

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]:
        return {name: self.full(name, model[name]) for name in sorted(model)}, per_element(optimizer, self.full)

    def full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor from this rank's block (collective over the groups that cut it)."""
        block = self.blocks.get(name)
        whole = tensor.detach()
        for group, dim in block.gathers if block is not None else ():
            whole = all_gather_along(whole, group, dim)
        return whole


def apply_grid_tensor_parallel(model: nn.Module, plan: Mapping[str, str], grid: Grid | Cube, *,
                               allow_missing: bool = False) -> GridLayout:
    """Replace the planned modules of `model` in place by their grid (or cube) versions; see the module's
    docstring."""
    check_ties(model, plan, allow_missing=allow_missing)
    resolved = resolve_plan(model, plan, allow_missing=allow_missing)
    _check_covered(model, resolved, grid)
    sliced: dict[int, nn.Parameter] = {}  # id(whole parameter) -> its block here: a tie stays one parameter
    blocks: dict[int, Block] = {}
    heads = grid.turned if isinstance(grid, Cube) else grid.stream
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if style in ("heads_dropout", "sequence_dropout"):
            if not isinstance(module, KeyedDropout):
                raise TypeError(f"tensor-parallel style {style!r} applies to KeyedDropout, but {name!r} is a "
                                f"{type(module).__name__}: change the plan entry for it")
            acts: Activations = heads if style == "heads_dropout" else grid.stream
            module.split_along(0, acts.row_block, acts.row_parts)  # the micro-batch's rows
            module.split_along(1 if style == "heads_dropout" else 2, acts.width.index, acts.width.size)
            continue
        replacement = _build(module, name, style, grid)
        described = replacement.blocks() if hasattr(replacement, "blocks") else {}
        for attr, param in list(replacement.named_parameters(recurse=False)):
            full = getattr(module, attr)
            shared = sliced.get(id(full))
            if shared is not None:  # another end of a tied weight (cut alike: check_ties)
                setattr(replacement, attr, shared)
                continue
            sliced[id(full)] = param
            blocks[id(param)] = described[attr]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    kinds = ((cube_matrix(grid, "column"), vector_block(grid.stream), vector_block(grid.turned))
             if isinstance(grid, Cube) else (matrix_block(grid), vector_block(grid.stream)))
    layout = GridLayout(kinds=kinds)
    for pname, param in model.named_parameters():
        if id(param) in blocks:
            layout.blocks[pname] = layout.ids[id(param)] = blocks[id(param)]
    return layout


def _check_covered(model: nn.Module, resolved: Mapping[str, str], grid: Grid | Cube) -> None:
    """Every parameter belongs to a planned module (see the module's docstring)."""
    planned = tuple(f"{name}." for name in resolved)
    left = [name for name, _ in model.named_parameters() if not name.startswith(planned)]
    if left:
        mode = "3d" if isinstance(grid, Cube) else "2d / 2.5d"
        raise ValueError(f"tp_mode {mode} splits every activation into blocks of rows and width, and the plan leaves "
                         f"out the parameters {left[:4]}{' ...' if len(left) > 4 else ''}: their modules would compute "
                         "on blocks as if they were whole. Give each a style (column / row for a Linear, embedding, "
                         "norm for RMSNorm / LayerNorm), or use tp_mode 1d")


def _hf_rms_norm(module: nn.Module) -> bool:
    """Hugging Face's plain RMSNorm (Llama's, Mistral's, Qwen's: x / rms(x) * weight, eps as variance_epsilon);
    Gemma's (1 + weight) is not one."""
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and \
        isinstance(getattr(module, "weight", None), torch.Tensor)


def _build(module: nn.Module, name: str, style: str, grid: Grid | Cube) -> nn.Module:
    cube = isinstance(grid, Cube)
    if style in ("column", "row", "column_gather") and type(module) in (nn.Linear, KernelLinear):
        gather = style == "column_gather"  # logits whole on every rank (HF's lm_head)
        if isinstance(grid, Cube):
            return CubeLinear(module, grid, "column" if gather else style, gather=gather)
        return GridLinear(module, grid, gather=gather)
    if style == "embedding" and isinstance(module, nn.Embedding):
        if module.max_norm is not None:
            raise ValueError(f"{name}: a grid embedding does not support max_norm (it renormalises rows other ranks "
                             "hold); use tp_mode 1d")
        return CubeEmbedding(module, grid) if isinstance(grid, Cube) else GridEmbedding(module, grid)
    if style == "norm" and (isinstance(module, NORMS) or _hf_rms_norm(module)):
        if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
            raise ValueError(f"{name}: a grid norm normalises over the last dim only, and {name} over "
                             f"{tuple(module.normalized_shape)}; use tp_mode 1d")
        if getattr(module, "weight", None) is None:
            raise ValueError(f"{name}: a grid norm needs an elementwise weight (elementwise_affine=True)")
        return SplitNorm(module, grid.stream)
    if style == "vocab_output" and isinstance(module, VocabOutput):  # the logits of a column head
        return SplitOutput(module.vocab_size, grid.turned if isinstance(grid, Cube) else grid.stream)
    kinds = {"column": "nn.Linear", "row": "nn.Linear", "column_gather": "nn.Linear", "embedding": "nn.Embedding",
             "norm": "RMSNorm or nn.LayerNorm", "vocab_output": "VocabOutput"}
    mode = "3d" if cube else "2d"
    if style in kinds:
        raise TypeError(f"tensor-parallel style {style!r} under tp_mode {mode} applies to {kinds[style]}, but {name!r} "
                        f"is a {type(module).__name__}: change the plan entry for it, or use tp_mode 1d")
    raise ValueError(f"tensor-parallel style {style!r} ({name}) has no {mode} form: the grid has no replicated "
                     "activation to gather into or to keep a partial module on; use tp_mode 1d")
