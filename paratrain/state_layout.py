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
the engine changes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch

from paratrain.comm.placement import Placements
from paratrain.topology.mesh import Mesh

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
