"""Cut a model into pipeline chunks: an ordered list of layers, split into contiguous ranges.

A model is described as layers (paratrain.nn.recipe.Layer), each a few modules under their names
in the whole model and a function that runs them, by its recipe's `layers`, or, for an
nn.Sequential, its children:

    a recipe's:     e.g. tok_emb | blocks.0 | ... | blocks.{L-1} | head (norm, head, output)
    nn.Sequential:  0 | 1 | ... (its children)

The p x v chunks are contiguous ranges of layers, given as split points or balanced by a cost
estimate (parameters and forward FLOPs per layer). A rank's `StageModel` holds the layers of its
chunks under the names the whole model gives them ("blocks.5.mlp.up.weight" on whichever rank holds
block 5), so checkpoints, tensor-parallel plans, recompute patterns and ZeRO all work on it as on
the whole model.

A weight tied across the first and last stage (found by identity: a language model's embedding and
head, any user's shared tensor) becomes two parameters when its ends land on different ranks: the copy starts equal, and the gradient strategies sum the two gradients over the
ranks holding them ("tied group"), so both stay equal; checkpoints hold it once, under its first
name. A tie between other stages is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.placement import Placements
from paratrain.config.errors import ConfigError
from paratrain.nn.documents import refuse_documents
from paratrain.nn.recipe import Layer, Run
from paratrain.nn.ties import tied_parameters
from paratrain.pipeline.schedules import Schedule
from paratrain.pipeline.split import balanced_split  # (torch-free: the planner reads it too)
from paratrain.state_layout import ModelState, OptimizerState
from paratrain.topology.mesh import AxisGroup, Mesh

__all__ = ["Layer", "PipelineLayout", "StageModel", "balanced_split", "chunk_ranges", "model_layers", "sequential_layers"]  # Layer: paratrain.nn.recipe's


def sequential_layers(model: nn.Sequential) -> list[Layer]:
    layers = []
    for name, child in model.named_children():
        params = sum(p.numel() for p in child.parameters())
        layers.append(Layer(name, {name: child}, _child_runner(name), float(max(params, 1))))
    return layers


def _child_runner(name: str) -> Run:
    def run(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return stage.get_submodule(name)(x)

    return run


def model_layers(model: nn.Module) -> list[Layer]:
    """An nn.Sequential's children as layers; other models give theirs by their recipe."""
    if isinstance(model, nn.Sequential):
        return sequential_layers(model)
    raise TypeError(f"pipeline parallelism cuts a model by its recipe's layers, or an nn.Sequential's children; a "
                    f"{type(model).__name__} has neither: express the model as nn.Sequential of its layers, or pass "
                    "parallelize(..., layers=model -> list[Layer]) (paratrain.models.hf.llama_layers for HF Llama / "
                    "Mistral)")


def chunk_ranges(layers: Sequence[Layer], parts: int, split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer ranges of the chunks: from `split` (start indices of chunks 1..parts-1) or balanced."""
    n = len(layers)
    if split:
        starts = [0, *split]
        if len(starts) != parts or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
            raise ConfigError(
                f"pipeline split {list(split)} must give {parts - 1} increasing layer indices in 1..{n - 1} "
                f"(the first layer of chunks 1..{parts - 1}); layers are {[layer.name for layer in layers][:6]}...")
    else:
        starts = balanced_split([layer.cost for layer in layers], parts)
    return [(s, e) for s, e in zip(starts, [*starts[1:], n])]


class StageModel(nn.Module):
    """The layers of one pipeline rank's chunks, registered under their names in the whole model."""

    def __init__(self, model: nn.Module, layers: list[Layer], ranges: list[tuple[int, int]], schedule: Schedule,
                 rank: int) -> None:
        """ranges: each of the schedule's stages x chunks chunks' [start, end) layers; this pipeline rank keeps
        the chunks the schedule places on it."""
        super().__init__()
        if len(ranges) != schedule.stages * schedule.chunks:
            raise ValueError(f"{len(ranges)} layer ranges for a schedule of {schedule.stages} x {schedule.chunks} "
                             "chunks")
        chunks = schedule.chunks_of(rank)
        self.layers = layers
        self.ranges = {c: ranges[c] for c in chunks}
        """Chunk index -> [start, end) layers, for this rank's chunks."""
        self.chunks = chunks
        self.first_chunk = 0 in chunks
        self.last_chunk = len(ranges) - 1 in chunks
        for c in chunks:
            start, end = ranges[c]
            for layer in layers[start:end]:
                for name, module in layer.modules.items():
                    _register(self, name, module)
                for name, tensor in layer.buffers.items():  # tensors of the whole model it reads (rotary tables)
                    if name not in self._buffers:
                        self.register_buffer(name, tensor, persistent=False)
        self.tied: dict[str, str] = {}
        """Name of a tied copy on this rank -> the name the checkpoint keeps it under."""
        self.tied_name: str | None = None
        """This rank's end of a weight tied across stages: its gradient is summed with the other end's."""
        own = {name for name, _ in self.named_parameters(remove_duplicate=False)}
        for names in _ties_across_ranks(model, layers, ranges, schedule):
            here = [name for name in names if name in own]
            if not here:
                continue
            if names[0] in here:  # the first end: the checkpoint's name, counted in the norm
                self.tied_name = names[0]
                continue
            source = model.get_parameter(names[0])
            copy = nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)
            for name in here:  # every alias of it on this stage shares the one copy
                module_name, _, attr = name.rpartition(".")
                setattr(self.get_submodule(module_name) if module_name else self, attr, copy)
                self.tied[name] = names[0]
            self.tied_name = here[0]

    def check_positions(self) -> None:
        """Refuse micro-batches with document positions that the model cannot take: a layer whose run takes none
        (any layer of the whole model, so every rank refuses alike), or a module of this stage that says why it
        cannot (a `refuses_positions` message: Hugging Face rotary embeddings under context parallelism)."""
        missing = [layer.name for layer in self.layers if not layer.positions]
        if missing:
            raise ValueError(f"the micro-batches carry document positions (a third tensor) and pipeline layers "
                             f"{missing[:4]} do not take them (Layer.positions is False): give their runs a "
                             "positions argument, or batches of (inputs, targets) only")
        refuse_documents(self)

    def run_chunk(self, chunk: int, x: torch.Tensor, positions: torch.Tensor | None = None,
                  tokens: torch.Tensor | None = None) -> torch.Tensor:
        """positions[B, S]: the micro-batch's packed documents (paratrain.nn.documents), for every layer; tokens: its
        input token ids, for the layers that take them (Layer.tokens)."""
        start, end = self.ranges[chunk]
        for layer in self.layers[start:end]:  # (check_positions refused positions a layer cannot take)
            given = {"tokens": tokens} if layer.tokens else {}
            x = layer.run(self, x, **given) if positions is None else layer.run(self, x, positions, **given)
        return x


def _ties_across_ranks(model: nn.Module, layers: list[Layer], ranges: list[tuple[int, int]],
                       schedule: Schedule) -> list[tuple[str, ...]]:
    """The tied weights of `model` whose ends lie on different pipeline ranks (the schedule's placement);
    refused unless their ranks are the first and the last, which the mesh's "tied" group joins."""
    rank_of: dict[str, int] = {}
    for chunk, (start, end) in enumerate(ranges):
        for layer in layers[start:end]:
            for module_name in layer.modules:
                rank_of[module_name] = schedule.rank_of(chunk)
    pp, across = schedule.stages, []
    for names in tied_parameters(model):
        ranks = {rank for name in names for module_name, rank in rank_of.items()
                 if name.startswith(module_name + ".")}
        if len(ranks) < 2:
            continue
        if ranks != {0, pp - 1}:
            raise ConfigError(f"{' and '.join(names)} are one tied parameter, and the pipeline cut puts its ends on "
                              f"ranks {sorted(ranks)} of {pp}: a weight can be tied across stages only between the "
                              "first and the last (an embedding and its head); cut the stages so that its ends share "
                              "a stage, or untie it")
        across.append(names)
    if len(across) > 1:
        raise ConfigError(f"{len(across)} weights are tied across pipeline stages ({across}): paratrain keeps one "
                          "(the embedding and its head); untie the others or cut the stages so that their ends "
                          "share a stage")
    return across


def _register(root: nn.Module, dotted: str, module: nn.Module) -> None:
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.ModuleDict())
        node = getattr(node, part)
    node.add_module(leaf, module)


def _settings(group: Mapping[str, Any]) -> str:
    return repr(sorted((k, v) for k, v in group.items() if k != "params"))


def gather_stages(stage: StageModel, model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any],
                  group: AxisGroup) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This stage's name-keyed (model, optimizer) state -> the whole model's, on every pp rank
    (collective over pp). Tied copies are left out: the first stage's end holds the weight.
    Optimizer param groups with the same settings (weight decay, ...) are merged across stages."""
    skip = set(stage.tied)
    mine = ({k: v.detach().cpu() for k, v in model.items() if k not in skip},
            {k: {key: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for key, v in values.items()}
             for k, values in optimizer["state"].items() if k not in skip},
            [{**g, "params": [n for n in g["params"] if n not in skip]} for g in optimizer["param_groups"]])
    parts: list[Any] = [None] * group.size
    dist.all_gather_object(parts, mine, group=group.pg)
    whole_model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for part_model, part_state, part_groups in parts:
        whole_model.update(part_model)
        state.update(part_state)
        for g in part_groups:
            merged = groups.setdefault(_settings(g), {**g, "params": []})
            merged["params"] = merged["params"] + list(g["params"])
    return whole_model, {"state": state, "param_groups": [g for g in groups.values() if g["params"]]}



@dataclass(frozen=True)
class PipelineLayout:
    """What cutting the model into stages did, as a paratrain.state_layout.StateLayout: this rank holds
    its stage's layers under their whole-model names, and a copy of a weight tied to another stage."""

    stage: StageModel
    group: AxisGroup

    @property
    def splits(self) -> dict[str, tuple[int, int, int]]:
        return {}

    @property
    def tied(self) -> dict[str, str]:
        return self.stage.tied

    def place(self, placements: Placements, mesh: Mesh) -> None:
        """This rank's end of a weight tied across stages is summed with the other end's over the mesh's
        "tied" group; the last stage's copy counts in the gradient norm once."""
        if self.stage.tied_name is not None:
            placements.tie(self.stage.get_parameter(self.stage.tied_name), mesh.groups.get("tied"),
                           counted=not self.stage.tied)

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]:
        return gather_stages(self.stage, model, optimizer, self.group)
