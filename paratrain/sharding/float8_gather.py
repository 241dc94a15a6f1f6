"""ZeRO-3's float8 gathers: the weights of float8 linears move as one byte an element instead of two.

Under precision fp8 with the tensorwise recipe a float8 linear multiplies with its weight cast to e4m3 by one
power-of-two scale, the whole weight's. Gathering the bf16 weight and casting it after moves twice the bytes the
matmul reads; so a flat group of such weights is gathered in float8 instead (torchtitan's float8 all-gather for
FSDP2):

    1. each rank takes the amax of every weight's elements in its shard, reduced (max) over the shard group and the
       tp group that slices the weight: the whole weight's amax, hence the linear's own scale
       (paratrain.nn.kernels.power_of_two_scale);
    2. it casts its shard to e4m3 with each element's weight's scale and all-gathers the bytes;
    3. each weight is read back as its float8 values divided by the scale (exact in bf16) into the full buffer.

The linear then casts that weight again: its values lie on the float8 grid of a power-of-two scale, and the scale
it takes from them is the same one or twice it (the amax may round down to half the format's max), so its float8
values are the gathered ones, exactly scaled: the products, the loss and every gradient are bitwise those of a
bf16 gather (tests/distributed/test_float8.py). Only the tensorwise recipe gathers so: a rowwise linear casts its
weight along rows forward and along columns backward, which one gathered grid cannot serve both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm import Pending, all_gather_async, all_reduce
from paratrain.comm.flat import FlatGroup
from paratrain.nn.kernels import power_of_two_scale
from paratrain.topology import AxisGroup

FLOAT8 = torch.float8_e4m3fn
"""The forward's format, which the tensorwise recipe casts weights to."""


class Float8Gather:
    """How one flat group of float8 linears' weights is gathered (start() replaces the bf16 all-gather)."""

    def __init__(self, group: FlatGroup, shard_group: AxisGroup, *, also: AxisGroup | None) -> None:
        """also: the group that splits these weights besides the shard group (tp), whose slices' amaxes the scales
        are reduced over too; None: whole on this rank but for the shard."""
        self.group, self.shard_group, self.also = group, shard_group, also
        self.pieces = [(i, max(offset, group.lo), min(offset + shape.numel(), group.hi))
                       for i, (offset, shape) in enumerate(zip(group.offsets, group.shapes))]
        """(parameter, start, end) of each parameter's elements inside this rank's shard (empty where start >= end)."""

    def start(self) -> _Dequantised:
        """Cast this rank's shard and start gathering it; wait() on the result fills the group's full buffer."""
        group, shard = self.group, self.group.shard
        amax = torch.zeros(len(group.params), dtype=torch.float32, device=shard.device)
        for i, lo, hi in self.pieces:
            if lo < hi:
                amax[i] = shard[lo - group.lo: hi - group.lo].abs().max().float()  # this rank's part of weight i
        for over in (self.shard_group, self.also):
            if over is not None:
                all_reduce(amax, over, op=dist.ReduceOp.MAX)
        scales = power_of_two_scale(amax, FLOAT8)
        cast = torch.zeros(group.shard_numel, dtype=FLOAT8, device=shard.device)  # the padding stays 0
        for i, lo, hi in self.pieces:
            if lo < hi:
                mine = slice(lo - group.lo, hi - group.lo)
                cast[mine] = (shard[mine].float() * scales[i]).to(FLOAT8)
        gathered = torch.empty(group.padded, dtype=torch.uint8, device=shard.device)
        pending = all_gather_async(gathered, cast.view(torch.uint8), self.shard_group)
        return _Dequantised(pending, gathered, scales, group)


class _Dequantised:
    """A float8 all-gather in flight; wait() reads each weight back into the group's full buffer."""

    def __init__(self, pending: Pending, gathered: torch.Tensor, scales: torch.Tensor, group: FlatGroup) -> None:
        self.pending, self.gathered, self.scales, self.group = pending, gathered, scales, group

    @torch.no_grad()
    def wait(self) -> None:
        self.pending.wait()
        values = self.gathered.view(FLOAT8)
        for i, view in enumerate(self.group.views(self.group.param_flat)):
            offset = self.group.offsets[i]
            view.view(-1).copy_(values[offset: offset + view.numel()].float() / self.scales[i])
