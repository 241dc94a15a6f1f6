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

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.comm.regions import gather_from_sequence_region
from paratrain.config.errors import ConfigError
from paratrain.topology.mesh import AxisGroup

BATCH_NORM_MODES = ("sync", "local")
"""parallelize's batch_norm=: 'sync' (statistics over every dp rank's samples: layout-free) or 'local'
(each rank its own, as DDP without SyncBatchNorm: the loss then depends on dp)."""


class SyncedBatchNorm(_BatchNorm):
    """The forward of a BatchNorm1d/2d/3d (or torch's SyncBatchNorm) whose batch statistics cover every
    rank of `group`. synced_batch_norm() makes one from a module: an instance of a subclass of the
    module's own class (isinstance(m, nn.BatchNorm2d) still holds, for code that freezes BatchNorms),
    with the module's parameters, buffers, hooks and training flag."""

    group: AxisGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.running_mean is not None:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]  # every dim but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in float32 at least
        channels = x.shape[1]
        mean_local = xs.mean(dims)  # [C]
        m2_local = (xs - mean_local.view(shape)).pow(2).sum(dims)  # [C]
        count = torch.full((1,), float(x.numel() // channels), dtype=xs.dtype, device=x.device)
        # all-gather forward, reduce-scatter backward: the sequence region's pair of actions, over dp
        rows = gather_from_sequence_region(torch.cat([count, mean_local, m2_local]).unsqueeze(0), self.group, 0)
        counts, means, m2s = rows[:, :1].detach(), rows[:, 1: 1 + channels], rows[:, 1 + channels:]  # [dp, 1|C|C]
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
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor: float | torch.Tensor = (1.0 / self.num_batches_tracked if self.momentum is None  # no host read
                                        else self.momentum)
        unbiased = var * (n / (n - 1).clamp(min=1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype) * factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype) * factor)


_SYNCED: dict[type, type] = {}


def synced_batch_norm(module: _BatchNorm, group: AxisGroup) -> SyncedBatchNorm:
    """`module` as a SyncedBatchNorm over `group`: a new instance of SyncedBatchNorm and the module's own
    class, holding the module's parameters, buffers, hooks and training flag (the module itself is left
    as it was)."""
    cls = type(module)
    if cls not in _SYNCED:
        name = f"Synced{cls.__name__}"
        _SYNCED[cls] = type(name, (SyncedBatchNorm, cls), {"__module__": __name__, "__qualname__": name})
        globals().setdefault(name, _SYNCED[cls])  # importable by name, so a model holding one pickles
    synced = _SYNCED[cls].__new__(_SYNCED[cls])
    synced.__dict__.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    synced.group = group
    return synced


def batch_norms(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm modules (BatchNorm1d/2d/3d, SyncBatchNorm, synced or not)."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def apply_synced_batch_norm(model: nn.Module, group: AxisGroup) -> list[str]:
    """Replace every BatchNorm of `model` in place by a SyncedBatchNorm over `group`; returns their names."""
    names = [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)
             and not isinstance(m, SyncedBatchNorm)]
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, _BatchNorm)
        model.set_submodule(name, synced_batch_norm(module, group))
    return names


def check_accumulation(norms: Sequence[str], *, dp: int, accumulation: int, micro_batch: int) -> None:
    """Refuse synced batch statistics that no single process would take: dp > 1 ranks that each cut their
    share of the global batch into several micro-batches (their k-th micro-batches together are no
    contiguous part of the global batch, which a single process's micro-batch is)."""
    if dp > 1 and accumulation > 1 and norms:
        names = ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else "")
        raise ConfigError(
            f"BatchNorm ({names}) normalises over the samples of one forward: with dp = {dp} and accumulation "
            f"{accumulation} (micro-batches of {micro_batch} rows per rank), the ranks' k-th micro-batches together "
            "are no micro-batch of a single process (each rank holds a contiguous slice of the global batch), so "
            f"the loss would depend on the layout. Use one micro-batch per step (micro_batch = global_batch / dp = "
            f"{micro_batch * accumulation}): the dp ranks then train as one process with micro-batches of the "
            "global batch; or batch_norm='local' for per-rank statistics (DDP's default: not layout-free)")
