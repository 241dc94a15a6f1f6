"""The exchange's plan (paratrain.optim.exchange), as pure functions of who holds what: each unit's owner, the
buckets (each owner's units in the order every rank sorts them), and for each bucket what this rank sends, receives
and maps, as positions in its inputs (`flat`) or its owned units (`plan_bucket`) or as counts of elements on every
rank (`bucket_sizes`: what the planner prices, paratrain.planner.optimizer, without positions or tensors).

A unit's holders fall into classes: the ranks holding the same elements of it (replicas), each class a disjoint part
of the unit. A class sends its elements to the owner from the owner itself when it is in the class, else from the
class's lowest rank; the owner sends every member of every class but itself its elements back."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from paratrain.optim.positions import Positions, Span

Unit = tuple[str, int]
"""(whole tensor's name, index of the unit among its leading slices)."""


Classes = Sequence[tuple[Sequence[int], int]]
"""A unit's holders: (the ranks holding one part of it, in ascending order; how many elements that part has)."""


def assign_owners(units: Sequence[Unit], holders: Mapping[Unit, Sequence[int]], flops: Mapping[Unit, int],
                  world: int) -> tuple[dict[Unit, int], list[int]]:
    """Each unit's owner, largest first: its least loaded holder (ties: the lowest rank), unless that holder would
    then carry more than the least loaded rank of all plus the largest unit, when that rank owns it instead (it
    receives the whole unit: more traffic, but no rank waits on another's Newton-Schulz for longer than one
    unit's). Returns the owners and the FLOPs each of the `world` ranks runs as one: the loads differ by at most
    the largest unit's (as in longest-processing-time scheduling: each unit lands where the total stays within
    the smallest load plus the largest unit, and the smallest load only grows)."""
    load = [0] * world
    owner: dict[Unit, int] = {}
    largest = max((flops[u] for u in units), default=0)
    for u in sorted(units, key=lambda u: (-flops[u], u)):
        holder = min(holders[u], key=lambda r: (load[r], r))
        least = min(range(world), key=lambda r: (load[r], r))
        owner[u] = holder if load[holder] + flops[u] <= load[least] + largest else least
        load[owner[u]] += flops[u]
    return owner, load


def bucket_units(units: Sequence[Unit], sizes: dict[Unit, int], owner: dict[Unit, int], world: int,
                 bucket_elements: int) -> list[list[Unit]]:
    """Buckets of about `bucket_elements` elements in which every owner that has units left owns its share
    (bucket_elements / owners, at least one unit), each owner's units taken in the order every rank sorts them:
    so every rank orthogonalises in every bucket, and the owners of one bucket run at once (buckets of consecutive
    units would leave one owner working while the rest wait for the next bucket's all-to-all)."""
    queues: list[list[Unit]] = [[] for _ in range(world)]
    for u in units:
        queues[owner[u]].append(u)
    share = max(1, bucket_elements // max(1, sum(1 for q in queues if q)))
    buckets: list[list[Unit]] = []
    while any(queues):
        bucket: list[Unit] = []
        for queue in queues:
            taken = 0
            while queue and (taken == 0 or taken + sizes[queue[0]] <= share):
                taken += sizes[queue[0]]
                bucket.append(queue.pop(0))
        buckets.append(bucket)
    return buckets


@dataclass(frozen=True)
class Bucket:
    """One bucket's exchange on this rank: positions in `flat` (this rank's inputs) or in its owned units."""

    send: list[Positions]
    """Gather: my local positions, per owner."""
    recv_at: list[Positions]
    """Gather: owned positions, per sender."""
    back: list[Positions]
    """Scatter: owned positions, per holder."""
    back_at: list[Positions]
    """Scatter: my local positions, per owner."""
    own_local: Positions
    own_owned: Positions
    """The elements of units I own that I hold myself: where they are locally and in the owned buffer."""
    units: list[tuple[int, tuple[int, int]]]
    """The units I own: (offset in the owned buffer, shape)."""
    owned: int

    @property
    def gather_messages(self) -> int:
        """Elements of the gather's send and receive buffers."""
        return sum(len(x) for x in self.send) + sum(len(x) for x in self.recv_at)

    @property
    def scatter_messages(self) -> int:
        return sum(len(x) for x in self.back) + sum(len(x) for x in self.back_at)


class BucketFigures(Protocol):
    """What a bucket holds on one rank, in elements (a Bucket's, or a BucketSizes')."""

    @property
    def owned(self) -> int: ...

    @property
    def gather_messages(self) -> int: ...

    @property
    def scatter_messages(self) -> int: ...


def peak_elements(numel: int, buckets: Sequence[BucketFigures], *, alone: bool) -> int:
    """Elements a rank holding `numel` of the matrices holds at the peak of an exchange's step: the inputs handed
    to it and its copy of them (2 numel) and, at the worst bucket k, its owned units, gather k's or scatter k's
    messages (the larger: the gather's buffers are freed before the scatter starts), beside gather k + 1 and
    scatter k - 1 in flight. alone: no other rank (nothing is sent, only the owned units)."""
    if alone:
        return 2 * numel + max((b.owned for b in buckets), default=0)
    peak = 0
    for k, b in enumerate(buckets):
        ahead = buckets[k + 1].gather_messages if k + 1 < len(buckets) else 0
        behind = buckets[k - 1].scatter_messages if k else 0
        peak = max(peak, b.owned + ahead + behind + max(b.gather_messages, b.scatter_messages))
    return 2 * numel + peak


@dataclass(frozen=True)
class BucketSizes:
    """One bucket on one rank, in elements: what plan_bucket's Bucket holds, counted."""

    owned: int = 0
    sent: int = 0
    """Gather: elements it sends owners."""
    received: int = 0
    """Gather: elements it receives as an owner."""
    returned: int = 0
    """Scatter: elements it sends holders as an owner."""
    given: int = 0
    """Scatter: elements it receives from owners."""

    @property
    def gather_messages(self) -> int:
        return self.sent + self.received

    @property
    def scatter_messages(self) -> int:
        return self.returned + self.given


def bucket_sizes(units: Sequence[Unit], classes: Mapping[Unit, Classes], owner: Mapping[Unit, int],
                 sizes: Mapping[Unit, int], world: int) -> list[BucketSizes]:
    """plan_bucket's counts for every rank of `world` at once (index: the rank), from each unit's classes."""
    owned, sent, received, returned, given = ([0] * world for _ in range(5))
    for u in units:
        o = owner[u]
        owned[o] += sizes[u]
        for ranks, n in classes[u]:
            sender = o if o in ranks else ranks[0]
            if sender != o:
                sent[sender] += n
                received[o] += n
            for r in ranks:
                if r != o:
                    returned[o] += n
                    given[r] += n
    return [BucketSizes(owned[r], sent[r], received[r], returned[r], given[r]) for r in range(world)]


def plan_bucket(units: Sequence[Unit], everyone: list[dict[Unit, tuple]], mine: dict[Unit, list[tuple[int, int, int]]],
            owner: dict[Unit, int], shape_of: dict[Unit, tuple[int, int]], rank: int, world: int,
            device: torch.device) -> Bucket:
    send: list[list[Span]] = [[] for _ in range(world)]
    recv_at: list[list[Span]] = [[] for _ in range(world)]
    back: list[list[Span]] = [[] for _ in range(world)]
    back_at: list[list[Span]] = [[] for _ in range(world)]
    own_local: list[Span] = []
    own_owned: list[Span] = []
    owned_units: list[tuple[int, tuple[int, int]]] = []
    owned = 0
    for u in units:
        rows, cols = shape_of[u]
        size = rows * cols
        classes: dict[tuple, list[int]] = defaultdict(list)  # the same elements held -> the ranks holding them
        for r in range(world):
            if u in everyone[r]:
                classes[everyone[r][u][1]].append(r)
        if sum(n for sig in classes for _, n in sig) != size:
            raise ValueError(f"{u[0]} (unit {u[1]}): the ranks' pieces cover {sum(n for s in classes for _, n in s)}"
                             f" of its {size} elements once each; a matrix optimizer needs every element held by"
                             " exactly one set of replicas")
        o = owner[u]
        if o == rank:
            owned_units.append((owned, (rows, cols)))
        for sig, ranks in classes.items():
            sender = o if o in ranks else ranks[0]
            at = [(owned + start, n) for start, n in sig] if o == rank else []
            if rank in ranks:
                local = [(loc, n) for _, loc, n in mine[u]]
                if o == rank:
                    own_local += local
                    own_owned += at
                else:
                    back_at[o] += local
                    if sender == rank:
                        send[o] += local
            if o == rank:
                if sender != rank:
                    recv_at[sender] += at
                for r in ranks:
                    if r != rank:
                        back[r] += at
        if o == rank:
            owned += size

    def of(parts: list[list[Span]]) -> list[Positions]:
        return [Positions.of(p, device) for p in parts]

    return Bucket(of(send), of(recv_at), of(back), of(back_at), Positions.of(own_local, device),
                  Positions.of(own_owned, device), owned_units, owned)
