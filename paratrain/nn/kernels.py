"""How a linear layer multiplies: the kernel travels with the layer it was declared on.

A `LinearKernel` computes y = x W^T + b for one linear layer. The dense one is F.linear; a float8 one
(paratrain.memory.float8) quantises x, W and the output's gradient with scales that must be those of the logical
tensors, so it must know which process groups split them on this rank. The layer that splits them says so through a
`LinearSplit`: a tensor-parallel layer (paratrain.tensor_parallel.layers) knows which of the weight's dimensions it
holds a slice of; the kernel knows (from its builder) which group splits the tokens (context parallelism).

    KernelLinear(full, kernel)   an nn.Linear (the same Parameters) whose forward is kernel(x, W, b, WHOLE)
    kernel_of(linear)            the kernel a layer was declared with: KernelLinear's, else dense_linear

Strategies read kernel_of when they replace a linear by slices of it, so the kernel survives the replacement and
nothing sets it afterwards. This module is below the strategies: groups are opaque to it. power_of_two_scale is the
float8 scale both the float8 kernel and ZeRO-3's float8 gathers take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config.model_rules import FLOAT8_MULTIPLE


@dataclass(frozen=True)
class LinearSplit:
    """Which process groups split a linear's operands on this rank (None: whole here).

    out       the weight's rows W[out, :] and the output's features (a column-parallel layer)
    inner     the weight's columns W[:, in] and the input's features (a row-parallel layer)
    sequence  the input's dimension `sequence_dim` (sequence parallelism: a column-parallel layer's input arrives
              split along the sequence): the kernel gathers it, and reduce-scatters the input's gradient"""

    out: object | None = None
    inner: object | None = None
    sequence: object | None = None
    sequence_dim: int = 1


WHOLE = LinearSplit()
"""A linear whose weight and features are whole on this rank."""


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 split: LinearSplit) -> torch.Tensor:
        """x [..., in] (in/|inner| under a split), weight [out, in] (this rank's slice): x W^T (+ bias)."""
        ...


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes x in: autocast's when it is on for x's device (a dry run's meta tensors have none),
    else x's own."""
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def check_float8_tokens(x: torch.Tensor, what: str) -> None:
    """On CUDA, torch._scaled_mm needs every dimension a multiple of 16, the weight gradient's inner one (the tokens
    this rank multiplies, x's rows) too: refused with the rule before it fails inside the matmul."""
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cuda" and rows % FLOAT8_MULTIPLE:
        raise ValueError(f"{what}: float8 on CUDA needs the tokens a rank multiplies (micro-batch x sequence, over "
                         f"the ranks that split them) a multiple of {FLOAT8_MULTIPLE}, got {rows}: change the "
                         "micro-batch or the sequence length")


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 split: LinearSplit = WHOLE) -> torch.Tensor:
    """F.linear: the kernel of every linear not declared otherwise (it needs no split; a sequence-parallel layer
    gathers its input for it)."""
    if split.sequence is not None:
        raise ValueError("dense_linear gathers nothing: a sequence-parallel layer gathers the input itself")
    return F.linear(x, weight, bias)


class KernelLinear(nn.Linear):
    """An nn.Linear that multiplies with `kernel`, holding the Parameters of `full` (names and values unchanged)."""

    def __init__(self, full: nn.Linear, kernel: LinearKernel) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = full.in_features, full.out_features
        self.weight, self.bias = full.weight, full.bias  # the same Parameters
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias, WHOLE)


def kernel_of(linear: nn.Module) -> LinearKernel:
    """The kernel `linear` was declared with: a KernelLinear's own, F.linear for any other."""
    return linear.kernel if isinstance(linear, KernelLinear) else dense_linear


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32: the largest power of two s with amax * s <= dtype's largest value; 1 where amax is 0.

    From amax = m 2^e (m in [0.5, 1)) and the format's max = mf 2^ef: s = 2^(ef - e), halved when m > mf. Exact
    integer arithmetic on the exponent: the same on every kernel and machine."""
    mf, ef = math.frexp(torch.finfo(dtype).max)
    mantissa, exponent = torch.frexp(amax.float())
    power = (ef - exponent - (mantissa > mf).to(exponent.dtype)).clamp(-126, 127)
    power = torch.where(amax > 0, power, torch.zeros_like(power))
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), power)


@runtime_checkable
class QuantisingKernel(Protocol):
    """A kernel that casts its operands (float8), for layers that run their own products (a 2d grid's SUMMA): it
    casts a tensor with the scale of the logical tensor, reduced over the groups the layer names."""

    rowwise: bool
    """One scale per row along each product's reduced dimension; False: one per tensor."""
    forward_dtype: torch.dtype
    gradient_dtype: torch.dtype
    tokens: tuple[object, ...]
    """The groups splitting the tokens besides the layer's (cp)."""

    def scale(self, tensor: torch.Tensor, dtype: torch.dtype, *, rows: bool, whole: Iterable[object | None],
              split_rows: Iterable[object | None], operand: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cast tensor, its float32 scale: [rows, 1] or a scalar); whole: the groups splitting its columns,
        split_rows: those splitting its rows."""
        ...


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T of cast operands (torch._scaled_mm, float32 accumulation), each divided back by its
    scale ([rows, 1] or a scalar). On the CPU the same products in float32 (a float8 value and the product of two
    are exact there), accumulated in float32 and scaled alike: torch 2.13's CPU kernel took 3.8 s for one
    [1024, 128] x [128, 384] e4m3 product on an Intel Xeon (AVX-512), 1.3 ms at 512 rows, so the CPU runs it
    this way everywhere (the same kernel in every layout: the suite's comparisons are within one kernel)."""
    scale_a, scale_b = a_scale.reciprocal(), b_scale.reciprocal().t()
    if a.device.type == "cpu":
        return (torch.mm(a.float(), b.float().t()) * scale_a * scale_b).to(out_dtype)
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

