"""Matrix optimizers as a kind: what an optimizer whose update needs each whole weight matrix (Muon's Newton-Schulz;
Shampoo, SOAP or Dion would plug in the same way) asks of the layout.

Such an optimizer keeps its state per element (Muon's momentum), so ZeRO's flat shards, tensor-parallel slices and
expert shards hold it as they hold Adam's moments, and checkpoints stay layout-free. Only one function of each step
is not element-wise: the map from a matrix's update input to its update (`MatrixStep`). The optimizer hands every
tensor it updates (a parameter whole, a slice of one, a flat shard over several) with that input to a `Matrices`,
which runs the map on whole matrices and gives back the outputs shaped as the inputs:

    LocalMatrices   every matrix whole on this rank (one process, or data parallelism without ZeRO)
    MatrixExchange  paratrain.optim.exchange: each matrix has an owner rank; holders send it their pieces, it maps
                    the whole, and sends each holder its part back

A "unit" is one matrix: a 2-D weight, or one of a 3-D tensor's leading slices (each expert of a MoE layer's stacked
weights its own matrix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

MatrixStep = Callable[[torch.Tensor], torch.Tensor]
"""A matrix (rows, cols) -> its update (rows, cols): Muon's orthogonalisation."""


@dataclass(frozen=True)
class Segment:
    """Elements [offset, offset + length) of a tensor the optimizer updates belong to unit matrices of shape
    `shape` (rows, cols): what a learning rate adjusted by shape needs."""

    offset: int
    length: int
    shape: tuple[int, int]


def unit_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix each unit of a whole tensor of `shape` is: its last two dims (leading dims index the units)."""
    if len(shape) < 2:
        raise ValueError(f"a tensor of shape {tuple(shape)} is not a matrix: a matrix optimizer needs >= 2 dims")
    return int(shape[-2]), int(shape[-1])


class Matrices(Protocol):
    """Where the whole matrices of the tensors a matrix optimizer updates are."""

    def segments(self, tensor: torch.Tensor) -> list[Segment]:
        """The parts of `tensor` (one the optimizer updates) and the unit shapes they belong to."""
        ...

    def apply(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor]], step: MatrixStep) -> list[torch.Tensor]:
        """For each (tensor the optimizer updates, its update input shaped like it), the update: `step` applied to
        every whole unit matrix the inputs are parts of. Collective for an exchange: every rank calls it at the
        same step with its own tensors (an empty list included)."""
        ...


class LocalMatrices:
    """Every tensor the optimizer updates is whole: its units are its own leading slices."""

    def segments(self, tensor: torch.Tensor) -> list[Segment]:
        rows, cols = unit_shape(tensor.shape)
        return [Segment(0, tensor.numel(), (rows, cols))]

    def apply(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor]], step: MatrixStep) -> list[torch.Tensor]:
        outputs = []
        for tensor, value in inputs:
            rows, cols = unit_shape(tensor.shape)
            if tensor.dim() == 2:
                outputs.append(step(value))
            else:
                units = value.reshape(-1, rows, cols)
                outputs.append(torch.stack([step(unit) for unit in units]).view(tensor.shape))
        return outputs


@runtime_checkable
class MatrixOptimizer(Protocol):
    """An optimizer with a whole-matrix step (paratrain.optim.Muon): parallelize gives its step a MatrixExchange."""

    def matrix_tensors(self) -> list[torch.Tensor]:
        """The tensors it updates as matrices now (parameters, or the flat shards ZeRO pointed it at)."""
        ...

    def step_with(self, matrices: Matrices) -> None:
        """One step, the whole-matrix part run by `matrices`."""
        ...

    @property
    def matrix_dtype(self) -> torch.dtype:
        """The dtype its matrix inputs travel in."""
        ...


@runtime_checkable
class NamedFactory(Protocol):
    """An optimizer factory that chooses by parameter name (paratrain.optim.MuonFactory): parallelize calls
    `named` with (name in the whole model, parameter) pairs instead of calling it with the parameters."""

    def named(self, params: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer: ...


WHOLE_TENSOR_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Muon, torch.optim.LBFGS)
"""torch's optimizers whose step reads a whole tensor (Muon orthogonalises each parameter) or every element at once
(L-BFGS's dot products): wrong, not just slow, on a slice."""


def check_layout_fits(optimizer: torch.optim.Optimizer, cuts: Sequence[str]) -> None:
    """Refuse an optimizer the layout's `cuts` (what splits the tensors it updates: "ZeRO-2's flat shards", ...) would
    feed slices; a MatrixOptimizer is served whole matrices by the exchange, except under the parameter server."""
    if not cuts:
        return
    name = type(optimizer).__name__
    if isinstance(optimizer, MatrixOptimizer):
        served = [c for c in cuts if "parameter server" in c]
        if served:
            raise ValueError(f"{name} is a matrix optimizer: it needs each whole matrix, which {served[0]} do not "
                             "give; use ps_mode 'off' (ZeRO-1/2/3 shard its state) or AdamW")
        return
    if isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS):
        raise ValueError(f"{name} reads each parameter whole, and this layout gives it {' and '.join(cuts)}: its "
                         "update would be computed on slices (silently wrong). Use paratrain.optim.Muon / "
                         "MuonFactory (each matrix orthogonalised whole by an owner rank, any layout), or a layout "
                         "without those cuts (plain dp, pp)")
