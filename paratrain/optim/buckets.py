"""The exchange's buckets (paratrain.optim.exchange): consecutive units in the order every rank sorts them, and for
each bucket what this rank sends, receives and maps, as positions in its inputs (`flat`) or its owned units."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from paratrain.optim.positions import Positions, Span

Unit = tuple[str, int]
"""(whole tensor's name, index of the unit among its leading slices)."""


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
