"""StateLayout: what a strategy that splits the model's state tells the rest of the house.

Tensor parallelism (slices of a layer), expert parallelism (a share of the experts) and pipeline
parallelism (a stage's layers) each change which tensors a rank holds. Each returns one object of this
protocol from its `apply_*` step, and the engine, the materialiser, the gradient placements and the
checkpoint code loop over those objects instead of branching on the axis:

    splits     name -> (dim, index, parts): this rank holds part `index` of `parts` of the whole tensor
    tied       name of a tied copy here -> the name the whole model keeps it under
    place      where its parameters' gradients are summed, sharded and counted in the norm
    to_whole   name-keyed (model, optimizer) state of this rank -> the whole model's (collective)

The way back needs no method: loading reads, for each piece `splits` and `tied` describe, only the
elements it holds (paratrain.hybrid.pieces, paratrain.hybrid.view), from a checkpoint's files or from a
whole state dict in memory alike. A new axis that splits state implements these four and nothing in
the engine changes. DimCuts gives the first, second and fourth to layouts whose tensors are each cut along one
dim over one group (tensor parallelism's, expert tensor parallelism's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from paratrain.comm.placement import Placements
from paratrain.comm.regions import all_gather_along
from paratrain.topology.mesh import AxisGroup, Mesh

ModelState = dict[str, torch.Tensor]
OptimizerState = dict[str, Any]
"""torch's optimizer state_dict keyed by parameter name: {"state": {name: {key: value}}, "param_groups": [...]}."""


class StateLayout(Protocol):
    @property
    def splits(self) -> Mapping[str, tuple[int, int, int]]: ...

    @property
    def tied(self) -> Mapping[str, str]: ...

    def place(self, placements: Placements, mesh: Mesh) -> None: ...

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]: ...


def per_element(optimizer: Mapping[str, Any],
                convert: Callable[[str, torch.Tensor], torch.Tensor]) -> OptimizerState:
    """Named optimizer state with every per-element tensor (shaped like its parameter: Adam's moments,
    not its step count) passed through convert(name, tensor), in name order."""
    state = optimizer["state"]
    return {**optimizer, "state": {
        name: {key: convert(name, value) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
               for key, value in sorted(state[name].items())}
        for name in sorted(state)}}


@dataclass
class DimCuts:
    """Parameters each cut along one dim over `group` (a state layout's splits, tied, to_whole and full; tensor
    parallelism's and expert tensor parallelism's layouts add where the gradients go)."""

    group: AxisGroup
    split_dims: dict[str, int] = field(default_factory=dict)
    """Parameter name -> the dim split over the group; names not here are replicated on every tp rank."""
    split_ids: frozenset[int] = frozenset()
    """id() of the split parameters, for strategies that hold parameters, not names."""
    blocks: dict[str, int] = field(default_factory=dict)
    """Parameter name -> equal blocks of its split dim each split alike (a fused q | k | v: 3); absent: 1."""

    @property
    def splits(self) -> dict[str, tuple[int, ...]]:
        """name -> (dim, this rank's index, parts[, blocks]) of every split parameter (paratrain.state_layout)."""
        return {name: (dim, self.group.index, self.group.size, *([self.blocks[name]] if name in self.blocks else []))
                for name, dim in self.split_dims.items()}

    @property
    def tied(self) -> dict[str, str]:
        return {}

    def to_whole(self, model: ModelState, optimizer: OptimizerState) -> tuple[ModelState, OptimizerState]:
        """Slices -> whole tensors, model and per-element optimizer state (collective over the group)."""
        return self.gather_full(model), per_element(optimizer, self.full)

    def full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of parameter `name` (or of state shaped like it) from this rank's slice:
        all-gathered along its split dim (collective over the group); replicated ones come back as they are."""
        dim = self.split_dims.get(name)
        if dim is None:
            return tensor
        blocks = self.blocks.get(name, 1)
        if blocks == 1:
            return all_gather_along(tensor.detach(), self.group, dim)
        shape = tensor.shape  # each block's slices gathered: [..., blocks, size / (blocks tp), ...] along the inner
        viewed = tensor.detach().reshape(*shape[:dim], blocks, shape[dim] // blocks, *shape[dim + 1:])
        whole = all_gather_along(viewed, self.group, dim + 1)
        return whole.reshape(*shape[:dim], shape[dim] * self.group.size, *shape[dim + 1:])

    def gather_full(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every split tensor of a name-keyed state made whole (collective over the group; name order)."""
        return {name: self.full(name, state[name]) for name in sorted(state)}
