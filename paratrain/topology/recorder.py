"""A flight recorder: the last collectives this rank issued on each of its groups, numbered per group.

When a collective fails or times out, each rank's record (written to the launcher's folder by the
worker) shows where every rank was: the launcher names the ranks that never entered the collective
the others waited in, with the last one they finished there and their stack (`hang_report`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Entry:
    axis: str
    ranks: tuple[int, ...]
    seq: int
    """1 for the first collective this rank issued on this group, then 2, 3, ..."""
    op: str
    shape: tuple[int, ...]
    dtype: str
    state: str = "entered"
    """'entered', 'done' (completed on this rank) or 'failed'."""
    order: int = 0
    """Its place among every collective this rank issued, on any group (1, 2, ...)."""
    started: float = 0.0
    """time.perf_counter() when this rank entered it."""


class FlightRecorder:
    def __init__(self, rank: int, *, keep: int = 64) -> None:
        self.rank = rank
        self.entries: deque[Entry] = deque(maxlen=keep)
        self._seq: dict[tuple[str, tuple[int, ...]], int] = {}
        self._count = 0
        self.waited_s = 0.0
        """Seconds this rank spent inside collectives that block it (a blocking call, or the wait() of one in
        flight): the time waiting for peers and for the wire, which paratrain.train.stragglers subtracts."""
        self.window: dict[tuple[str, tuple[int, ...]], list[Entry]] | None = {}
        """Every collective since the last collective-order check, per group (paratrain.comm.order);
        None once checks stop (the window would otherwise grow for the whole run)."""

    def enter(self, op: str, axis: str, ranks: tuple[int, ...], tensor: torch.Tensor) -> Entry:
        key = (axis, ranks)
        self._seq[key] = self._seq.get(key, 0) + 1
        self._count += 1
        entry = Entry(axis, ranks, self._seq[key], op, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                      order=self._count, started=time.perf_counter())
        self.entries.append(entry)
        if self.window is not None:
            self.window.setdefault(key, []).append(entry)
        return entry

    def take_window(self, axis: str, ranks: tuple[int, ...]) -> list[Entry]:
        """The group's collectives since the last take (forgotten here)."""
        return self.window.pop((axis, ranks), []) if self.window is not None else []

    def to_dict(self, stack: str = "") -> dict[str, Any]:
        return {"rank": self.rank, "entries": [asdict(e) for e in self.entries], "stack": stack}

    def dump(self, folder: str | Path, stack: str = "") -> None:
        path = Path(folder) / f"rank{self.rank}.json"
        path.write_text(json.dumps(self.to_dict(stack)))


@dataclass(frozen=True)
class Absent:
    """A rank of a group that never entered a collective another rank of that group failed in (or, with
    no record of its own, is not known to have): what the hang report names, and what the launcher
    names first when that rank had to be stopped (paratrain.launch.local)."""

    rank: int
    op: str
    seq: int
    axis: str
    ranks: tuple[int, ...]
    waiter: int
    """The rank that failed in it (the lowest whose record says so)."""
    last: str | None
    """Its last collective on that group ("#36 (all_reduce, done)", or "none"); None: it left no record."""
    stack: str = ""

    @property
    def where(self) -> str:
        return f"{self.op} #{self.seq} on the {self.axis} group (ranks {list(self.ranks)})"

    def line(self, *, partial: bool = False) -> str:
        """Its line of the hang report (partial: as in `hang_report`)."""
        if self.last is None:
            return (f"rank {self.rank} left no record of {self.where}: stopped, or stuck outside Python"
                    + (", or on another node (records are shared across nodes through --save)" if partial else ""))
        return (f"rank {self.rank} never entered {self.where}, where rank {self.waiter} waited; its last collective "
                f"there is {self.last}" + (f"; its stack:\n{self.stack}" if self.stack else ""))


def hang_report(folder: str | Path, *, partial: bool = False) -> list[str]:
    """Lines naming, for each collective some rank failed in, the ranks of its group that never
    entered it (and the last collective they finished there, and their stack), from the ranks' records.
    partial: the folder holds only this node's ranks of a multi-node job (a rank without a record may
    be on another node)."""
    return [absent.line(partial=partial) for absent in absent_ranks(folder)]


def absent_ranks(folder: str | Path) -> list[Absent]:
    """For each collective some rank failed in (by that rank, then its order), the ranks of its group
    that never entered it or left no record, from the ranks' records in `folder`."""
    records = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        records[int(data["rank"])] = data
    absent: list[Absent] = []
    seen: set[tuple[str, tuple[int, ...], int]] = set()
    for rank in sorted(records):
        for entry in records[rank]["entries"]:
            if entry["state"] != "failed":
                continue
            ranks, key = tuple(entry["ranks"]), (entry["axis"], tuple(entry["ranks"]), entry["seq"])
            if key in seen:
                continue
            seen.add(key)
            for other in ranks:
                if other == rank:
                    continue
                last: str | None = None
                stack = ""
                if other in records:
                    mine = [e for e in records[other]["entries"] if (e["axis"], tuple(e["ranks"])) == key[:2]]
                    if mine and mine[-1]["seq"] >= entry["seq"]:
                        continue  # it got there too
                    last = f"#{mine[-1]['seq']} ({mine[-1]['op']}, {mine[-1]['state']})" if mine else "none"
                    stack = records[other].get("stack", "").strip("\n")
                absent.append(Absent(rank=other, op=entry["op"], seq=entry["seq"], axis=entry["axis"], ranks=ranks,
                                     waiter=rank, last=last, stack=stack))
    return absent
