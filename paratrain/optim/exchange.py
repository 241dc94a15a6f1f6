"""MatrixExchange: a matrix optimizer's whole-matrix step under any layout.

Each unit matrix (a 2-D weight, or one expert's slice of a stacked 3-D one) gets one owner rank among the ranks that
hold some of it, chosen once so that the owners' Newton-Schulz FLOPs balance (largest first, to the least loaded
holder). Each step:

    gather    every element of a unit travels once to its owner, from the owner itself where it holds it, else from
              the lowest rank of the replicas holding it (dp replicas, ranks a ZeRO shard or a tp slice repeats on)
    step      the owner maps the whole unit (Muon: Newton-Schulz)
    scatter   the owner sends every holder (every replica) the elements it holds

in one all-to-all each way over the ranks given. The pieces a rank holds come as `Held` runs of whole elements,
whatever cut them: ZeRO-1/2/3's flat shards (through several tensors), 1-D tensor-parallel slices, 2-D / 2.5-D / 3-D
blocks, expert shards over expert parallelism and expert-tp, pipeline stages (each holds its own units: nothing crosses stages).
Elements travel in the optimizer's Newton-Schulz dtype (bfloat16 by default: half float32's bytes).

Bytes per step (elements times the dtype's size): gather = the elements of each unit outside the owner's own
piece, each once; scatter = the elements each holder other than the owner holds (replicas each) -- `traffic()`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from paratrain.comm import all_to_all
from paratrain.optim.matrices import MatrixStep, Segment, unit_shape
from paratrain.topology import AxisGroup

Run = tuple[int, int, int]
"""(element of the held range, element of the whole tensor, count): consecutive in both."""
Unit = tuple[str, int]
"""(whole tensor's name, index of the unit among its leading slices)."""


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

    def __init__(self, held: Sequence[Held], group: AxisGroup | None, *, dtype: torch.dtype) -> None:
        """held: this rank's pieces of the tensors the optimizer updates as matrices; group: the ranks holding any
        (all trainers: collective over them, once); dtype: what elements travel in (the optimizer's)."""
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
        self._plan(everyone, mine, rank, world)

    def _plan(self, everyone: list[dict[Unit, tuple]], mine: dict[Unit, list[tuple[int, int, int]]], rank: int,
              world: int) -> None:
        units = sorted({u for held in everyone for u in held})
        shape_of = {u: held[u][0] for held in everyone for u in held}
        flops = {u: newton_schulz_flops(shape_of[u]) for u in units}
        load = [0] * world
        owner: dict[Unit, int] = {}
        for u in sorted(units, key=lambda u: (-flops[u], u)):  # largest first, to the least loaded holder
            holders = [r for r in range(world) if u in everyone[r]]
            owner[u] = min(holders, key=lambda r: (load[r], r))
            load[owner[u]] += flops[u]
        self.owner_flops = load
        """Newton-Schulz FLOPs per step each rank of the group runs as an owner."""
        send: list[list[list[Span]]] = [[] for _ in range(world)]       # gather: my local positions, per owner
        recv_at: list[list[list[Span]]] = [[] for _ in range(world)]    # gather: owned positions, per sender
        back: list[list[list[Span]]] = [[] for _ in range(world)]       # scatter: owned positions, per holder
        back_at: list[list[list[Span]]] = [[] for _ in range(world)]    # scatter: my local positions, per owner
        own_local: list[list[Span]] = []
        own_owned: list[list[Span]] = []
        self.units: list[tuple[Unit, int, tuple[int, int]]] = []  # (unit, offset in the owned buffer, shape)
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
                self.units.append((u, owned, (rows, cols)))
            for sig, ranks in classes.items():
                sender = o if o in ranks else ranks[0]
                at = [(owned + start, n) for start, n in sig] if o == rank else None
                if rank in ranks:
                    local = [(loc, n) for _, loc, n in mine[u]]
                    if o == rank:
                        own_local.append(local)
                        own_owned.append(at)  # type: ignore[arg-type]
                    else:
                        back_at[o].append(local)
                        if sender == rank:
                            send[o].append(local)
                if o == rank:
                    if sender != rank:
                        recv_at[sender].append(at)  # type: ignore[arg-type]
                    for r in ranks:
                        if r != rank:
                            back[r].append(at)  # type: ignore[arg-type]
            if o == rank:
                owned += size
        self.owned = owned
        device = self.tensors[0].device if self.tensors else torch.device("cpu")

        def cat(parts: list[list[Span]]) -> Positions:
            return Positions.of([span for part in parts for span in part], device)

        self._send, self._recv_at = [cat(x) for x in send], [cat(x) for x in recv_at]
        self._back, self._back_at = [cat(x) for x in back], [cat(x) for x in back_at]
        self._own_local, self._own_owned = cat(own_local), cat(own_owned)

    # ---- Matrices -----------------------------------------------------------------------------------------------
    def segments(self, tensor: torch.Tensor) -> list[Segment]:
        return self._segments[id(tensor)]

    def apply(self, inputs: Sequence[tuple[torch.Tensor, torch.Tensor]], step: MatrixStep) -> list[torch.Tensor]:
        values = {id(t): v for t, v in inputs}
        if len(values) != len(self.tensors) or any(id(t) not in values for t in self.tensors):
            raise ValueError("MatrixExchange.apply: the inputs must be exactly the tensors it was planned for")
        flat = torch.cat([values[id(t)].reshape(-1).to(self.dtype) for t in self.tensors]) if self.tensors else \
            torch.empty(0, dtype=self.dtype)
        owned = torch.empty(self.owned, dtype=flat.dtype, device=flat.device)
        received = self._exchange(flat, self._send, self._recv_at)
        for positions, values_in in zip(self._recv_at, received):
            positions.put(owned, values_in)
        self._own_owned.put(owned, self._own_local.take(flat))
        for _, offset, (rows, cols) in self.units:
            unit = owned[offset: offset + rows * cols]
            unit.copy_(step(unit.view(rows, cols)).reshape(-1))
        result = torch.zeros_like(flat)
        received = self._exchange(owned, self._back, self._back_at)
        for positions, values_in in zip(self._back_at, received):
            positions.put(result, values_in)
        self._own_local.put(result, self._own_owned.take(owned))
        return [result[b: b + t.numel()].view(t.shape) for b, t in zip(self.base, self.tensors)]

    def _exchange(self, source: torch.Tensor, send: list[Positions], recv: list[Positions]) -> list[torch.Tensor]:
        """source[send[r]] to rank r, for every r; what rank r sent, in the sizes `recv` gives."""
        if self.group is None:
            return [source.new_empty(0)] * len(recv)
        out_splits = [len(x) for x in recv]
        buffer = torch.cat([x.take(source) for x in send])
        received = source.new_empty(sum(out_splits))
        all_to_all(received, buffer, self.group, output_splits=out_splits, input_splits=[len(x) for x in send])
        return list(received.split(out_splits))

    def traffic(self) -> tuple[int, int]:
        """Elements this rank sends per step: (gather, scatter)."""
        return sum(len(x) for x in self._send), sum(len(x) for x in self._back)


Span = tuple[int, int]
"""(first position, count)."""
FEW_SPANS = 64
"""Positions in at most this many spans are copied span by span (slices), more by an expanded index."""


@dataclass(frozen=True)
class Positions:
    """Element positions kept as spans (a few integers per contiguous stretch, not 8 bytes per element), expanded
    into an index for the step that uses them."""

    starts: torch.Tensor
    counts: torch.Tensor
    total: int
    spans: tuple[Span, ...] | None
    """The spans, when at most FEW_SPANS (None: more)."""

    @classmethod
    def of(cls, spans: Sequence[Span], device: torch.device) -> Positions:
        merged: list[list[int]] = []
        for start, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += n
            elif n:
                merged.append([start, n])
        starts = torch.tensor([m[0] for m in merged], dtype=torch.long, device=device)
        counts = torch.tensor([m[1] for m in merged], dtype=torch.long, device=device)
        return cls(starts, counts, int(counts.sum()) if merged else 0,
                   tuple((a, n) for a, n in merged) if len(merged) <= FEW_SPANS else None)

    def __len__(self) -> int:
        return self.total

    def take(self, source: torch.Tensor) -> torch.Tensor:
        """source's elements at these positions, in order (copied span by span when there are few spans)."""
        if self.spans is not None:
            return torch.cat([source[a: a + n] for a, n in self.spans]) if self.spans else source.new_empty(0)
        return source[self.index()]

    def put(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """target at these positions = values, in order."""
        if self.spans is not None:
            at = 0
            for a, n in self.spans:
                target[a: a + n] = values[at: at + n]
                at += n
        else:
            target[self.index()] = values

    def index(self) -> torch.Tensor:
        if not self.total:
            return self.starts.new_empty(0)
        shift = self.starts - (torch.cumsum(self.counts, 0) - self.counts)
        # output_size: without it repeat_interleave reads the counts' sum back from the device (a host sync a step)
        return torch.arange(self.total, device=self.starts.device) + torch.repeat_interleave(shift, self.counts,
                                                                                             output_size=self.total)
