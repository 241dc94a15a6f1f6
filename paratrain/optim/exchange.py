"""MatrixExchange: a matrix optimizer's whole-matrix step under any layout.

Each unit matrix (a 2-D weight, or one expert's slice of a stacked 3-D one) gets one owner rank, chosen once so that
the owners' Newton-Schulz FLOPs balance to within the largest unit's (paratrain.optim.buckets.assign_owners: largest
first, to its least loaded holder, or to the least loaded rank where that holder would be over the bound: ZeRO-3's
small shards leave few holders to a unit). Each step:

    gather    every element of a unit travels once to its owner, from the owner itself where it holds it, else from
              the lowest rank of the replicas holding it (dp replicas, ranks a ZeRO shard or a tp slice repeats on)
    step      the owner maps the whole unit (Muon: Newton-Schulz)
    scatter   the owner sends every holder (every replica) the elements it holds

in buckets of about `bucket_elements` elements, one all-to-all each way per bucket over the ranks given, overlapped:
while the owners map bucket k, bucket k + 1's gather and bucket k - 1's scatter are in flight, and a step holds one
bucket's messages at a time instead of every matrix's. Each owner has its share of every bucket
(paratrain.optim.buckets), so a bucket's owners all work at once. The results are the same bits whatever the
buckets (each unit is mapped alone). The pieces a rank holds come as `Held` runs of whole elements, whatever cut
them: ZeRO-1/2/3's flat shards (through several tensors), 1-D tensor-parallel slices, 2-D / 2.5-D / 3-D blocks,
expert shards over expert parallelism and expert-tp, pipeline stages (each holds its own units; a unit goes to a
rank of another stage only where its own stage's ranks are over the balance bound). Elements travel in the optimizer's Newton-Schulz dtype (bfloat16 by default: half float32's bytes).

Bytes per step (elements times the dtype's size): gather = the elements of each unit outside the owner's own
piece, each once; scatter = the elements each holder other than the owner holds (replicas each) -- `traffic()`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from paratrain.comm import Pending, all_to_all_async
from paratrain.optim.matrices import MatrixStep, Segment, unit_shape
from paratrain.optim.buckets import Bucket, Unit, assign_owners, bucket_units, peak_elements, plan_bucket
from paratrain.topology import AxisGroup

Run = tuple[int, int, int]
"""(element of the held range, element of the whole tensor, count): consecutive in both."""


@dataclass(frozen=True)
class Held:
    """Elements [offset, offset + length) of `tensor` (one the optimizer updates) are elements of whole tensor `name`
    (shape `shape`), as `runs` say (run elements counted from `offset`)."""

    tensor: torch.Tensor
    offset: int
    length: int
    name: str
    shape: tuple[int, ...]
    runs: tuple[Run, ...]


def newton_schulz_flops(shape: tuple[int, int], steps: int = 5) -> int:
    """Multiply-adds x 2 of `steps` quintic iterations on a (rows, cols) matrix: X X^T, A A and B X, on the short
    side m and the long side n: steps (4 m^2 n + 2 m^3)."""
    m, n = min(shape), max(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


class MatrixExchange:
    """paratrain.optim.matrices.Matrices over the ranks of `group` (None: this rank alone holds everything)."""

    def __init__(self, held: Sequence[Held], group: AxisGroup | None, *, dtype: torch.dtype,
                 bucket_elements: int = 1 << 24) -> None:
        """held: this rank's pieces of the tensors the optimizer updates as matrices; group: the ranks holding any
        (all trainers: collective over them, once); dtype: what elements travel in (the optimizer's);
        bucket_elements: units are exchanged in buckets of about this many elements (a larger unit alone)."""
        self.group = group
        self.dtype = dtype
        self.tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}
        for h in held:
            if id(h.tensor) not in index:
                index[id(h.tensor)] = len(self.tensors)
                self.tensors.append(h.tensor)
        self.base = [0] * len(self.tensors)
        for k in range(1, len(self.tensors)):
            self.base[k] = self.base[k - 1] + self.tensors[k - 1].numel()
        self.numel = sum(t.numel() for t in self.tensors)
        self._segments: dict[int, list[Segment]] = defaultdict(list)
        mine: dict[Unit, list[tuple[int, int, int]]] = defaultdict(list)  # unit -> (position in unit, local, n)
        shapes: dict[Unit, tuple[int, int]] = {}
        for h in held:
            rows, cols = unit_shape(h.shape)
            size = rows * cols
            self._segments[id(h.tensor)].append(Segment(h.offset, h.length, (rows, cols)))
            local0 = self.base[index[id(h.tensor)]] + h.offset
            for first, whole, n in h.runs:
                while n > 0:  # split at unit boundaries
                    unit, at = divmod(whole, size)
                    take = min(n, size - at)
                    mine[(h.name, unit)].append((at, local0 + first, take))
                    shapes[(h.name, unit)] = (rows, cols)
                    first, whole, n = first + take, whole + take, n - take
        for runs in mine.values():
            runs.sort()
        signature = {u: (shapes[u], tuple((at, n) for at, _, n in runs)) for u, runs in mine.items()}
        rank, world = (group.index, group.size) if group is not None else (0, 1)
        everyone: list[dict[Unit, tuple]] = [signature]
        if group is not None:
            everyone = [{} for _ in range(world)]
            dist.all_gather_object(everyone, signature, group=group.pg)
        self._plan(everyone, mine, rank, world, bucket_elements)

    def _plan(self, everyone: list[dict[Unit, tuple]], mine: dict[Unit, list[tuple[int, int, int]]], rank: int,
              world: int, bucket_elements: int) -> None:
        units = sorted({u for held in everyone for u in held})
        shape_of = {u: held[u][0] for held in everyone for u in held}
        holders = {u: [r for r in range(world) if u in everyone[r]] for u in units}
        owner, load = assign_owners(units, holders, {u: newton_schulz_flops(shape_of[u]) for u in units}, world)
        self.owner_flops = load
        """Newton-Schulz FLOPs per step each rank of the group runs as an owner."""
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.buckets = [plan_bucket(part, everyone, mine, owner, shape_of, rank, world, device)
                        for part in bucket_units(units, {u: shape_of[u][0] * shape_of[u][1] for u in units}, owner,
                                                 world, bucket_elements)]
        self.owned = sum(b.owned for b in self.buckets)

    # ---- Matrices -----------------------------------------------------------------------------------------------
    def segments(self, tensor: torch.Tensor) -> list[Segment]:
        return self._segments[id(tensor)]

    def apply(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor]], step: MatrixStep) -> list[torch.Tensor]:
        """Bucket by bucket, overlapped: the next bucket's gather is in flight while this one's units are mapped,
        and this one's scatter while the next is mapped; each result is written back over its inputs in `flat`
        (every element belongs to one bucket, whose send buffers were copied out when its gather started)."""
        values = {id(t): v for t, v in inputs}
        if len(values) != len(self.tensors) or any(id(t) not in values for t in self.tensors):
            raise ValueError("MatrixExchange.apply: the inputs must be exactly the tensors it was planned for")
        flat = torch.cat([values[id(t)].reshape(-1).to(self.dtype) for t in self.tensors]) if self.tensors else \
            torch.empty(0, dtype=self.dtype)
        gathering = self._start(flat, self.buckets[0], gather=True) if self.buckets else None
        scattering: _InFlight | None = None
        for k, bucket in enumerate(self.buckets):
            arriving = gathering
            gathering = self._start(flat, self.buckets[k + 1], gather=True) if k + 1 < len(self.buckets) else None
            owned = torch.empty(bucket.owned, dtype=flat.dtype, device=flat.device)
            for positions, values_in in zip(bucket.recv_at, _wait(arriving)):
                positions.put(owned, values_in)
            arriving = None  # its buffers freed before the units are mapped
            bucket.own_owned.put(owned, bucket.own_local.take(flat))
            for offset, (rows, cols) in bucket.units:
                unit = owned[offset: offset + rows * cols]
                unit.copy_(step(unit.view(rows, cols)).reshape(-1))
            bucket.own_local.put(flat, bucket.own_owned.take(owned))
            sent = self._start(owned, bucket, gather=False)
            del owned
            if scattering is not None:
                self._finish(flat, scattering)
            scattering = sent
        if scattering is not None:
            self._finish(flat, scattering)
        return [flat[b: b + t.numel()].view(t.shape) for b, t in zip(self.base, self.tensors)]

    def _start(self, source: torch.Tensor, bucket: Bucket, *, gather: bool) -> _InFlight:
        """Start the bucket's gather (source: this rank's inputs, `flat`) or scatter (source: its owned units)."""
        send, recv = (bucket.send, bucket.recv_at) if gather else (bucket.back, bucket.back_at)
        if self.group is None:
            return _InFlight(bucket, None, [source.new_empty(0)] * len(recv))
        out_splits = [len(x) for x in recv]
        buffer = torch.cat([x.take(source) for x in send])
        received = source.new_empty(sum(out_splits))
        work = all_to_all_async(received, buffer, self.group, output_splits=out_splits,
                                input_splits=[len(x) for x in send])
        return _InFlight(bucket, work, list(received.split(out_splits)))

    @staticmethod
    def _finish(flat: torch.Tensor, scatter: _InFlight) -> None:
        """Wait for a bucket's scatter and write what each owner sent over this rank's inputs."""
        for positions, values_in in zip(scatter.bucket.back_at, _wait(scatter)):
            positions.put(flat, values_in)

    def peak_bytes(self) -> int:
        """Bytes of a step's matrix part at its peak: the inputs the optimizer hands apply (this rank's matrix
        elements in the exchange's dtype, which its caller holds meanwhile), `flat` (as many) and, at the worst
        bucket, its owned units and the messages in flight then (the next bucket's gather, this one's scatter and
        the previous one's; a message's send and receive buffers each). Newton-Schulz's own temporaries (about
        2 (m n + m^2) elements of the unit being mapped) and index tensors of positions in more than
        positions.FEW_SPANS spans (8 bytes an element, while one copy runs) are not counted."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        return peak_elements(self.numel, self.buckets, alone=self.group is None) * size

    def traffic(self) -> tuple[int, int]:
        """Elements this rank sends per step: (gather, scatter)."""
        return (sum(len(x) for b in self.buckets for x in b.send), sum(len(x) for b in self.buckets for x in b.back))


@dataclass
class _InFlight:
    bucket: Bucket
    work: Pending | None
    received: list[torch.Tensor]


def _wait(message: _InFlight | None) -> list[torch.Tensor]:
    assert message is not None
    if message.work is not None:
        message.work.wait()
    return message.received

