"""Collectives on an explicit AxisGroup, whose failures name the group and the operation.

torch's own errors on a timeout say little more than "timed out"; in a job with one group per
axis the first question is which group and which collective, so every call here answers it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.topology.mesh import AxisGroup
from paratrain.topology.recorder import Entry


# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter; older releases have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation and the group."""


def _enter(op: str, group: AxisGroup, tensor: torch.Tensor) -> Entry | None:
    """Log a collective this rank enters on `group` in its flight recorder (numbered per group)."""
    return group.recorder.enter(op, group.axis, group.ranks, tensor) if group.recorder is not None else None


def _close(entry: Entry | None, state: str, group: AxisGroup | None = None, waited: float | None = None) -> None:
    """Mark the entry; with `group`, count the time this rank was blocked in it (`waited`, else since it entered)
    into its recorder's waited_s."""
    if entry is not None:
        entry.state = state
        if group is not None and group.recorder is not None:
            group.recorder.waited_s += waited if waited is not None else time.perf_counter() - entry.started


def _fail(op: str, group: AxisGroup, tensor: torch.Tensor, error: Exception,
          entry: Entry | None = None) -> CollectiveError:
    _close(entry, "failed")
    where = f" (#{entry.seq} on this group)" if entry is not None else ""
    return CollectiveError(
        f"{op}{where} of {tuple(tensor.shape)} {tensor.dtype} on {group.describe()} failed on global "
        f"rank {group.ranks[group.index]}: {error}. A peer may have crashed or be stuck in a "
        "different collective; check the other ranks' errors."
    )


@dataclass
class Pending:
    """An asynchronous collective in flight; wait() raises CollectiveError on failure."""

    op: str
    group: AxisGroup
    tensor: torch.Tensor
    work: dist.Work
    entry: Entry | None = None

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as error:
            raise _fail(self.op, self.group, self.tensor, error, self.entry) from error
        _close(self.entry, "done", self.group, time.perf_counter() - started)


def all_reduce(tensor: torch.Tensor, group: AxisGroup, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In place: every rank of `group` ends with the reduction of all ranks' `tensor`."""
    entry = _enter("all_reduce", group, tensor)
    try:
        dist.all_reduce(tensor, op=op, group=group.pg)
    except RuntimeError as error:
        raise _fail("all_reduce", group, tensor, error, entry) from error
    _close(entry, "done", group)


def all_reduce_async(tensor: torch.Tensor, group: AxisGroup,
                     *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
    """Start an in-place all-reduce; call .wait() on the result before reading `tensor`."""
    entry = _enter("all_reduce", group, tensor)
    try:
        work = dist.all_reduce(tensor, op=op, group=group.pg, async_op=True)
    except RuntimeError as error:
        raise _fail("all_reduce", group, tensor, error, entry) from error
    assert work is not None
    return Pending("all_reduce", group, tensor, work, entry)


def broadcast(tensor: torch.Tensor, group: AxisGroup, *, src_index: int = 0) -> None:
    """In place: every rank of `group` ends with the tensor of the group's `src_index`-th rank."""
    entry = _enter("broadcast", group, tensor)
    try:
        dist.broadcast(tensor, src=group.ranks[src_index], group=group.pg)
    except RuntimeError as error:
        raise _fail("broadcast", group, tensor, error, entry) from error
    _close(entry, "done", group)


def reduce(tensor: torch.Tensor, group: AxisGroup, *, dst_index: int,
           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In place on the group's `dst_index`-th rank: the reduction of all ranks' `tensor` (elsewhere `tensor`
    is left undefined: a buffer, not a value)."""
    entry = _enter("reduce", group, tensor)
    try:
        dist.reduce(tensor, dst=group.ranks[dst_index], op=op, group=group.pg)
    except RuntimeError as error:
        raise _fail("reduce", group, tensor, error, entry) from error
    _close(entry, "done", group)


def reduce_scatter_async(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup,
                         *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
    """Start output = (sum over the group of `tensor`)[index * n : (index + 1) * n], n = output.numel()."""
    entry = _enter("reduce_scatter", group, tensor)
    try:
        work = _reduce_scatter_single(output, tensor, op=op, group=group.pg, async_op=True)
    except RuntimeError as error:
        raise _fail("reduce_scatter", group, tensor, error, entry) from error
    assert work is not None
    return Pending("reduce_scatter", group, tensor, work, entry)


def all_gather_async(output: torch.Tensor, shard: torch.Tensor, group: AxisGroup) -> Pending:
    """Start output = concatenation of every group rank's `shard`, in group order."""
    entry = _enter("all_gather", group, shard)
    try:
        work = _all_gather_single(output, shard, group=group.pg, async_op=True)
    except RuntimeError as error:
        raise _fail("all_gather", group, shard, error, entry) from error
    assert work is not None
    return Pending("all_gather", group, shard, work, entry)


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup, *, output_splits: list[int],
               input_splits: list[int]) -> None:
    """Rows [sum(input_splits[:j]), ... + input_splits[j]) of `tensor` go to the group's j-th rank;
    `output` receives, in group order, output_splits[j] rows from the j-th rank."""
    entry = _enter("all_to_all", group, tensor)
    try:
        dist.all_to_all_single(output, tensor, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group.pg)
    except RuntimeError as error:
        raise _fail("all_to_all", group, tensor, error, entry) from error
    _close(entry, "done", group)


def all_to_all_async(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup, *, output_splits: list[int],
                     input_splits: list[int]) -> Pending:
    """Start all_to_all; call .wait() on the result before reading `output` or writing `tensor`."""
    entry = _enter("all_to_all", group, tensor)
    try:
        work = dist.all_to_all_single(output, tensor, output_split_sizes=output_splits,
                                      input_split_sizes=input_splits, group=group.pg, async_op=True)
    except RuntimeError as error:
        raise _fail("all_to_all", group, tensor, error, entry) from error
    assert work is not None
    return Pending("all_to_all", group, tensor, work, entry)
