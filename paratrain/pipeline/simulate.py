"""Run every rank's pipeline program in simulated time, without processes.

It checks what a schedule must satisfy before any process starts:
- every chunk of a rank runs forward once per micro-batch, and its backward (B, or I then W) once,
  after its forward;
- sends and receives match: between two ranks, in each direction, the receiver takes the messages in
  the order the sender sends them (NCCL matches point-to-point operations by order);
- no rank waits forever: sends do not block (the executor posts them asynchronously), a receive
  blocks until its send has happened; if no rank can move, the ranks and what they wait for are
  reported.

And it measures, for given compute costs: the makespan, each rank's busy time (so the bubble
fraction), and each rank's peak number of micro-batch chunks in flight (forward done, activations
not yet released by B or W).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paratrain.config.parallel import ScheduleError
from paratrain.pipeline.schedules import Action, Schedule

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Relative times of a whole stage's forward and backward (backward ~ 2 forwards); a chunk of the
interleaved schedule costs 1 / v of these."""


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: tuple[float, ...]
    """Compute time of each rank."""
    peak_in_flight: tuple[int, ...]
    """Most micro-batch chunks holding activations at once, per rank."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the total time of all ranks: 1 - busy / (p x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time per rank over the ideal (busy) time: (makespan - busy) / busy, mean over ranks."""
        return sum((self.makespan - b) / b for b in self.busy) / len(self.busy)


def _check_coverage(programs: list[list[Action]], schedule: Schedule, microbatches: int) -> None:
    for rank, prog in enumerate(programs):
        mine = schedule.chunks_of(rank)
        counts = Counter((a.kind, a.chunk, a.mb) for a in prog if a.kind in ("F", "B", "I", "W"))
        # each micro-batch's chunk: F, then B or I and W apart (DualPipeV mixes the two)
        whole = {(c, mb) for k, c, mb in counts if k == "B"}
        expected = Counter((k, c, mb) for c in mine for mb in range(microbatches)
                           for k in (("F", "B") if (c, mb) in whole else ("F", "I", "W")))
        if counts != expected:
            missing = sorted(set(expected) - set(counts))[:4]
            extra = sorted((set(counts) - set(expected)) | {k for k, n in counts.items() if n > 1})[:4]
            raise ScheduleError(f"rank {rank}: every chunk must run F and B (or I and W) once per micro-batch; "
                                f"missing {missing}, unexpected or repeated {extra}")
        done: set[tuple[str, int, int]] = set()
        for action in prog:
            need = {"B": "F", "I": "F", "W": "I"}.get(action.kind)
            if need and (need, action.chunk, action.mb) not in done:
                raise ScheduleError(f"rank {rank}: {action!r} comes before {need}{action.chunk}.{action.mb}")
            done.add((action.kind, action.chunk, action.mb))


def _check_matching(programs: list[list[Action]], schedule: Schedule) -> None:
    """Between two ranks, the receiver takes the messages (activations and gradients alike) in the
    order the sender sends them: NCCL matches point-to-point operations between a pair by order."""
    sends: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    receives: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank, prog in enumerate(programs):
        for a in prog:
            if a.kind.startswith("SEND_"):
                # the receiver of SEND_F(c) waits for RECV_F(c + 1); of SEND_B(c), RECV_B(c - 1)
                target = a.chunk + 1 if a.kind == "SEND_F" else a.chunk - 1
                sends.setdefault((rank, schedule.peer(a)), []).append((a.kind[-1], target, a.mb))
            elif a.kind.startswith("RECV_"):
                receives.setdefault((schedule.peer(a), rank), []).append((a.kind[-1], a.chunk, a.mb))
    for key in sorted(set(sends) | set(receives)):
        sent, got = sends.get(key, []), receives.get(key, [])
        if key[0] == key[1]:  # a hand-off between two chunks of one rank (a V schedule's turn): local, by key
            sent, got = sorted(sent), sorted(got)
        if sent != got:
            src, dst = key
            raise ScheduleError(
                f"rank {src} -> rank {dst}: sent {sent[:6]}{'...' if len(sent) > 6 else ''} but received in the "
                f"order {got[:6]}{'...' if len(got) > 6 else ''}: point-to-point messages match in order")


def simulate(programs: list[list[Action]], schedule: Schedule, *, microbatches: int,
             costs: Mapping[str, float] | Sequence[Mapping[str, float]] = DEFAULT_COSTS,
             durations: Sequence[Mapping[tuple[str, int, int], float]] | None = None,
             latency: float = 0.0, events: list[tuple[int, str, int, int, float, float]] | None = None) -> Simulation:
    """Check the programs of all ranks (see the module doc) and run them in simulated time. schedule: where the
    chunks live (which rank holds each, whom each send reaches); the programs are its ranks', in rank order.
    costs: time of each action kind for a whole stage, the same on every rank or one mapping per rank
    (unbalanced stages); a chunk of the interleaved schedule costs 1 / chunks of it.
    durations: instead, each rank's time of each compute action, (kind, chunk, micro-batch) -> time
    (a replay of measured actions, paratrain.pipeline.timeline).
    latency: time a message takes from its send to its receiver (0: free communication).
    events: a list to append every compute action to, as (rank, kind, chunk, micro-batch, start, end)."""
    stages, chunks = schedule.stages, schedule.chunks
    per_rank = [costs] * stages if isinstance(costs, Mapping) else list(costs)
    if durations is not None and len(durations) != stages:
        raise ScheduleError(f"durations for {len(durations)} ranks, {stages} stages")
    if len(programs) != stages:
        raise ScheduleError(f"{len(programs)} programs for {stages} stages")
    _check_coverage(programs, schedule, microbatches)
    _check_matching(programs, schedule)
    position = [0] * stages
    clock = [0.0] * stages
    busy = [0.0] * stages
    in_flight = [0] * stages
    peak = [0] * stages
    sent: dict[tuple[str, int, int], float] = {}  # ("F"/"B", receiving chunk, mb) -> time sent
    while any(position[r] < len(programs[r]) for r in range(stages)):
        moved = False
        for r in range(stages):
            while position[r] < len(programs[r]):
                a = programs[r][position[r]]
                if a.kind.startswith("RECV_"):
                    key = (a.kind[-1], a.chunk, a.mb)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif a.kind == "SEND_F":
                    sent[("F", a.chunk + 1, a.mb)] = clock[r] + latency
                elif a.kind == "SEND_B":
                    sent[("B", a.chunk - 1, a.mb)] = clock[r] + latency
                else:
                    cost = (per_rank[r][a.kind] / chunks if durations is None
                            else durations[r][(a.kind, a.chunk, a.mb)])
                    if events is not None:
                        events.append((r, a.kind, a.chunk, a.mb, clock[r], clock[r] + cost))
                    clock[r] += cost
                    busy[r] += cost
                    if a.kind == "F":
                        in_flight[r] += 1
                        peak[r] = max(peak[r], in_flight[r])
                    elif a.kind in ("B", "W"):
                        in_flight[r] -= 1
                position[r] += 1
                moved = True
        if not moved:
            waiting = {r: programs[r][position[r]] for r in range(stages) if position[r] < len(programs[r])}
            raise ScheduleError(f"deadlock: every unfinished rank waits for a message never sent: {waiting}")
    return Simulation(makespan=max(clock), busy=tuple(busy), peak_in_flight=tuple(peak))
