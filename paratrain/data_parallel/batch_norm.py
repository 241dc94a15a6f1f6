"""BatchNorm with a layout-free meaning: statistics over the samples one process would normalise together.

A BatchNorm normalises each channel by the mean and variance of the samples of one forward. Under
data parallelism each rank's forward holds 1/dp of them, so plain BatchNorm (DDP's default) makes the
loss depend on the layout: dp = 2 normalises over half the samples that dp = 1 does. SyncedBatchNorm
takes the statistics over the forward's samples on every dp rank, so dp ranks with micro-batches of m
rows normalise exactly as one process with micro-batches of dp x m rows does, provided those are the
same samples: with one micro-batch per step (accumulation 1), the ranks' micro-batches together are
the whole global batch, which is the single process's micro-batch. With accumulation > 1 the ranks'
k-th micro-batches together are no micro-batch of any single process (each rank holds a contiguous
slice of the global batch), so the engine refuses that combination before the first update.

Per channel, one all-gather in forward and its conjugate (a reduce-scatter) in backward:

    x[N, C, *] on each rank -> per rank (count n_r, mean_r[C], M2_r[C]) -> all-gathered [dp, 2C + 1]
    mean = sum_r n_r mean_r / n,   var = (sum_r M2_r + sum_r n_r (mean_r - mean)^2) / n   (Chan et al.)
    y = (x - mean) / sqrt(var + eps) * weight + bias

Every rank combines the gathered rows in the same order, so every rank computes the same statistics,
and autograd carries the gradient through them (the backward of the gather sums each rank's part).
The running statistics are updated from the combined ones (unbiased variance, as torch does), so
they are identical on every rank and equal the single process's. Evaluation uses them as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.comm.regions import gather_from_sequence_region
from paratrain.topology.mesh import AxisGroup

BATCH_NORM_MODES = ("sync", "local")
"""parallelize's batch_norm=: 'sync' (statistics over every dp rank's samples: layout-free) or 'local'
(each rank its own, as DDP without SyncBatchNorm: the loss then depends on dp)."""


class SyncedBatchNorm(nn.Module):
    """A BatchNorm1d/2d/3d (or torch's SyncBatchNorm) whose batch statistics cover every rank of `group`.

    It adopts the module's own parameters and buffers under the same names, so optimizers, checkpoints
    and ZeRO see the same tensors."""

    def __init__(self, full: _BatchNorm, group: AxisGroup) -> None:
        super().__init__()
        self.group = group
        self.num_features, self.eps, self.momentum = full.num_features, full.eps, full.momentum
        self.register_parameter("weight", full.weight)
        self.register_parameter("bias", full.bias)
        self.register_buffer("running_mean", full.running_mean)
        self.register_buffer("running_var", full.running_var)
        self.register_buffer("num_batches_tracked", full.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.running_mean is not None:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]  # every dim but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in float32 at least
        n_local = x.numel() // x.shape[1]
        mean_local = xs.mean(dims)  # [C]
        m2_local = (xs - mean_local.view(shape)).pow(2).sum(dims)  # [C]
        count = torch.full((1,), float(n_local), dtype=xs.dtype, device=x.device)
        rows = gather_from_sequence_region(torch.cat([count, mean_local, m2_local]).unsqueeze(0), self.group, 0)
        counts, means, m2s = rows[:, :1].detach(), rows[:, 1: 1 + x.shape[1]], rows[:, 1 + x.shape[1]:]  # [dp, 1], [dp, C] x 2
        n = counts.sum()  # on the device: nothing is read back
        mean = (counts * means).sum(0) / n
        var = (m2s.sum(0) + (counts * (means - mean).pow(2)).sum(0)) / n  # biased: what normalises
        if self.training and self.running_mean is not None:
            self._update_running(mean.detach(), var.detach(), n)
        y = (xs - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        """As torch's BatchNorm: momentum, or a cumulative average (momentum None); unbiased variance."""
        assert self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / (n - 1).clamp(min=1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def batch_norms(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm modules (BatchNorm1d/2d/3d, SyncBatchNorm, or already synced)."""
    return [name for name, m in model.named_modules() if isinstance(m, (_BatchNorm, SyncedBatchNorm))]


def apply_synced_batch_norm(model: nn.Module, group: AxisGroup) -> list[str]:
    """Replace every BatchNorm of `model` in place by a SyncedBatchNorm over `group`; returns their names."""
    names = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, _BatchNorm)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, SyncedBatchNorm(module, group))
    return names
