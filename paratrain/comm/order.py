"""The collective-order check: the ranks of each group compare the collectives they issued on it.

Collectives match by position: the k-th call on a group meets the k-th call of every peer. Two
ranks that issue them in different orders usually hang, but not always: an all-reduce of [2, 3] on
one rank and of [3, 2] on the other moves the same bytes and returns garbage without an error. So
at the first step of a run (every step with --check-collectives) each group's ranks exchange a
digest of the sequence of (operation, shape, dtype) they issued on it since the last check (an
all-to-all's rows excepted: each rank sends its own number); on a
mismatch they find the first position where they differ, and every rank raises
CollectiveOrderError naming it and what each rank issued there.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from paratrain.topology.mesh import AxisGroup, Mesh
from paratrain.topology.recorder import Entry


class CollectiveOrderError(RuntimeError):
    """The ranks of a group issued different collectives at the same position."""


def _describe(entry: Entry | None) -> str:
    return "nothing" if entry is None else f"{entry.op} {list(entry.shape)} {entry.dtype}"


def _signature(entry: Entry) -> str:
    """What must agree across the group: an all-to-all's row count is each rank's own (uneven splits)."""
    shape = ["rows", *entry.shape[1:]] if entry.op == "all_to_all" else list(entry.shape)
    return f"{entry.op} {shape} {entry.dtype}"


def _digest(entries: list[Entry]) -> list[int]:
    """A running CRC-32 over the signatures: position k's value covers positions 0..k."""
    running, out = 0, []
    for entry in entries:
        running = zlib.crc32(_signature(entry).encode(), running)
        out.append(running)
    return out


def check_collective_order(mesh: Mesh, device: torch.device, *, keep_checking: bool = False) -> int:
    """Compare, over every group of this rank, the collectives issued since the last check; returns how
    many were compared. Collective over each group (every rank of the world must call it), one
    all-gather per group, a second one only on a mismatch. keep_checking False: this was the last
    check (the recorder stops keeping the sequence)."""
    recorder = mesh.recorder
    if recorder is None or recorder.window is None:
        return 0
    groups = {(g.axis, g.ranks): g for g in mesh.groups.values()}
    compared = 0
    for key in sorted(groups):  # the same order on every rank: no two groups wait on each other
        group = groups[key]
        entries = recorder.take_window(group.axis, group.ranks)
        compared += len(entries)
        digests = _digest(entries)
        mine = torch.tensor([len(entries), digests[-1] if digests else 0], dtype=torch.int64, device=device)
        theirs = [torch.empty_like(mine) for _ in group.ranks]
        dist.all_gather(theirs, mine, group=group.pg)  # not through paratrain.comm: not itself recorded
        if all(torch.equal(t, theirs[0]) for t in theirs):
            continue
        _raise_at_first_difference(group, entries, digests)
    if not keep_checking:
        recorder.window = None
    return compared


def _raise_at_first_difference(group: AxisGroup, entries: list[Entry], digests: list[int]) -> None:
    sequences: list[list[int] | None] = [None] * group.size
    dist.all_gather_object(sequences, digests, group=group.pg)
    assert all(s is not None for s in sequences)
    longest = max(len(s) for s in sequences)  # type: ignore[arg-type]
    position = next(k for k in range(longest)
                    if len({s[k] if k < len(s) else None for s in sequences}) > 1)  # type: ignore[index, arg-type]
    mine = entries[position] if position < len(entries) else None
    issued: list[str | None] = [None] * group.size
    dist.all_gather_object(issued, _describe(mine), group=group.pg)
    first_seq = entries[0].seq if entries else 0
    at = f"#{first_seq + position}" if first_seq else f"position {position + 1} since the last check"
    lines = "; ".join(f"rank {rank}: {what}" for rank, what in zip(group.ranks, issued))
    raise CollectiveOrderError(
        f"the ranks of {group.describe()} issued different collectives at {at}: {lines}. Collectives match "
        "by position, so the results from there on are wrong or the job hangs: a rank took another branch "
        "(a data-dependent if, a module skipped on some ranks, a different model or layout)")
