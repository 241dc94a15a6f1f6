"""Pipeline schedules as data: pure functions (stages, micro-batches, rank) -> list of actions.

The model is cut into p x v chunks; chunk c lives on pipeline rank c % p (v > 1: the interleaved
layout of Narayanan et al. 2021, rank r holding chunks r, r + p, r + 2p, ...). An action is

    F(c, mb)   forward of chunk c on micro-batch mb
    B(c, mb)   its whole backward (input and weight gradients)
    I(c, mb)   only the input gradient (zero bubble: what the previous stage waits for)
    W(c, mb)   only the weight gradient (zero bubble: deferred into what would be idle time)
    SEND_F / RECV_F (c, mb)   the activation leaving chunk c / arriving for chunk c
    SEND_B / RECV_B (c, mb)   the gradient leaving chunk c / arriving for chunk c

`compute_order` gives each schedule's compute actions; `with_communication` inserts the sends and
receives they imply (a receive right before the action that needs it, a send right after the action
that produced it), so a schedule is a complete program per rank, which the simulator
(paratrain.pipeline.simulate) checks and the executor (paratrain.pipeline.runtime) runs.

Schedules:
- gpipe (Huang et al. 2019): all forwards, then all backwards. In flight: m micro-batches.
- 1f1b (PipeDream-Flush, Narayanan et al. 2021): p - r - 1 warm-up forwards, then one forward and
  one backward alternately, then the remaining backwards. In flight: at most p - r.
- interleaved (Narayanan et al. 2021, section 2.2): 1F1B over v chunks per rank; needs m to be a
  multiple of p. Bubble (p - 1) / (v m) of the ideal time instead of (p - 1) / m.
- zero-bubble (after Qi et al. 2024's ZB-H1): backward split into I and W; list-scheduled so that I
  is on the critical path and W fills what 1F1B leaves idle, with 1F1B's in-flight bound (p - r).
  Each rank idles (p - 1)(F + I), 1F1B's (p - 1)(F + I + W) less W.
- zb-h1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1 as handcrafted there): 1F1B with the
  backward split into I and W, rank r deferring its W passes by r micro-batches, so that W fills the bubble
  1F1B leaves at the start of later stages and the tail of earlier ones. Each rank idles (p - 1)(F + I - W)
  when W <= F and W <= I (m >= p; in general (p - 1)(F + I - min(F, I, W))) and holds at most p micro-batches'
  activations or weight-gradient inputs: the first stage's 1F1B peak, on every stage.

`Schedule` is the one object the executor (paratrain.pipeline.runtime), the simulator, the point-to-point
exchange and the planner read: which rank holds each chunk, each rank's program, whether the backward is split
into I and W, and the bubble. Nothing outside this file branches on a schedule's name; a new schedule (a
V-shaped one placing two chunks a rank in a V) is a new entry here, its name and rules in
paratrain.config.parallel, and its test.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from paratrain.config.parallel import ScheduleError, check_schedule  # the names and rules: config; the programs: here

COMPUTE = ("F", "B", "I", "W")


class Action(NamedTuple):
    kind: str
    """F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B."""
    chunk: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


SPLIT_BACKWARD = frozenset({"zero-bubble", "zb-h1"})
"""The schedules whose backward runs as I (input gradient) and W (weight gradient) apart."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule over `stages` ranks and `chunks` model chunks a rank (stages x chunks in all)."""

    name: str
    stages: int
    chunks: int = 1

    def __post_init__(self) -> None:
        # the rules that do not depend on the micro-batch count (stages micro-batches satisfy those that do)
        check_schedule(self.name, self.stages, self.stages, self.chunks)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as I and W apart (a W keeps the chunk's weight-gradient inputs)."""
        return self.name in SPLIT_BACKWARD

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding chunk `chunk` (0 .. stages x chunks - 1): chunk c on rank c % p."""
        return chunk % self.stages

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks rank `rank` holds, in model order."""
        return [c for c in range(self.stages * self.chunks) if self.rank_of(c) == rank]

    def order(self, rank: int, microbatches: int) -> list[Action]:
        """The compute actions of `rank`, in the order it runs them."""
        return compute_order(self.name, self.stages, microbatches, rank, self.chunks)

    def program(self, rank: int, microbatches: int) -> list[Action]:
        """The whole program of `rank`: compute actions and the communication they imply."""
        return with_communication(self.order(rank, microbatches), self.stages, self.chunks)

    def peer(self, action: Action) -> int:
        """The pipeline rank a send goes to, or a receive comes from: the rank of the chunk after (forward) or
        before (backward) the action's."""
        return self.rank_of(action.chunk + _STEP[action.kind])

    def bubble(self, microbatches: int) -> float:
        """Idle share of a step (idle over total time per rank) with equal stages: gpipe, 1f1b (p - 1) / (m + p - 1);
        interleaved (p - 1) / (v m + p - 1) (the bubble is (p - 1) / (v m) of the ideal time); zero-bubble as
        paratrain schedules it, with F = I = W: each rank idles (p - 1)(F + I) against m (F + I + W) of work,
        2 (p - 1) / (3 m + 2 (p - 1)); zb-h1 idles (p - 1)(F + I - W), (p - 1) / (3 m + p - 1)."""
        p, m, v = self.stages, microbatches, self.chunks
        if m < 1:
            raise ValueError(f"micro-batches must be >= 1, got {m}")
        if self.name == "interleaved":
            return (p - 1) / (v * m + p - 1)
        if self.name == "zb-h1":
            return (p - 1) / (3.0 * m + p - 1)
        if self.splits_backward:
            return 2.0 * (p - 1) / (3.0 * m + 2.0 * (p - 1))
        return (p - 1) / (m + p - 1)


_STEP = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}


def compute_order(name: str, stages: int, microbatches: int, rank: int, chunks: int = 1) -> list[Action]:
    """The compute actions of `rank`, in the order it runs them."""
    check_schedule(name, stages, microbatches, chunks)
    p, m, r = stages, microbatches, rank
    if not 0 <= r < p:
        raise ScheduleError(f"rank {r} is not a pipeline rank of {p} stages")
    if name == "gpipe":
        return [Action("F", r, mb) for mb in range(m)] + [Action("B", r, mb) for mb in range(m)]
    if name == "1f1b":
        return _one_f_one_b(p, m, r, backward="B")
    if name == "zero-bubble":
        return _zero_bubble_h1(p, m, r)
    if name == "zb-h1":
        return _zb_h1(p, m, r)
    return _interleaved(p, m, r, chunks)


def _one_f_one_b(p: int, m: int, r: int, backward: str) -> list[Action]:
    warmup = min(p - r - 1, m)
    order = [Action("F", r, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", r, warmup + i), Action(backward, r, i)]
    order += [Action(backward, r, mb) for mb in range(m - warmup, m)]
    return order


def _zb_h1(p: int, m: int, r: int) -> list[Action]:
    """ZB-H1: 1F1B's warm-up (p - r - 1 forwards) and steady state, the backward as I then W, rank r's W passes each
    r micro-batches behind its I (the first r I's followed by none; the last r W's at the end). Rank r then holds,
    at its peak, the p - r micro-batches 1F1B would and r more waiting for W: p on every rank."""
    warmup = min(p - r - 1, m)
    order = [Action("F", r, mb) for mb in range(warmup)]
    for i in range(m):
        if i < m - warmup:
            order.append(Action("F", r, warmup + i))
        order.append(Action("I", r, i))
        if i >= r:
            order.append(Action("W", r, i - r))
    return order + [Action("W", r, mb) for mb in range(max(m - r, 0), m)]


def _zero_bubble_h1(p: int, m: int, r: int) -> list[Action]:
    return list(_zero_bubble_orders(p, m)[r])


@functools.lru_cache(maxsize=64)
def _zero_bubble_orders(p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """I/W split by list scheduling in simulated time (costs F = I = W = 1): whenever a stage is free it
    runs, in this priority, the next input gradient I whose upstream gradient has arrived, the next
    forward F whose input has arrived if fewer than p - s micro-batches are in flight (1F1B's memory
    bound), or the oldest pending weight gradient W; otherwise it waits for the next event. W fills
    what 1F1B leaves idle, and I, not the whole backward, is on the critical path."""
    cost = 1.0
    free = [0.0] * p
    done_f: list[dict[int, float]] = [{} for _ in range(p)]  # stage -> mb -> finish time
    done_i: list[dict[int, float]] = [{} for _ in range(p)]
    next_f, next_i = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    released = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    def choose(s: int, t: float) -> Action | None:
        def ready(finish: dict[int, float], mb: int) -> bool:
            return mb in finish and finish[mb] <= t

        k = next_i[s]
        if k < next_f[s] and (ready(done_f[s], k) if s == p - 1 else ready(done_i[s + 1], k)):
            return Action("I", s, k)
        if next_f[s] < m and next_f[s] - released[s] < p - s and (s == 0 or ready(done_f[s - 1], next_f[s])):
            return Action("F", s, next_f[s])
        return Action("W", s, pending_w[s][0]) if pending_w[s] else None

    while any(len(o) < 3 * m for o in orders):
        active = [st for st in range(p) if len(orders[st]) < 3 * m]
        t = min(free[st] for st in active)
        picked = next(((st, a) for st in active if free[st] == t for a in [choose(st, t)] if a), None)
        if picked is None:  # every stage free now waits: move them to the next event
            events = [f for d in (*done_f, *done_i) for f in d.values() if f > t]
            events += [free[st] for st in active if free[st] > t]
            if not events:
                raise ScheduleError(f"zero-bubble list scheduling is stuck at p={p}, m={m}")
            for st in active:
                if free[st] == t:
                    free[st] = min(events)
            continue
        st, action = picked
        if action.kind == "I":
            done_i[st][action.mb] = t + cost
            next_i[st] += 1
            pending_w[st].append(action.mb)
        elif action.kind == "F":
            done_f[st][action.mb] = t + cost
            next_f[st] += 1
        else:
            pending_w[st].pop(0)
            released[st] += 1
        orders[st].append(action)
        free[st] = t + cost
    return tuple(tuple(o) for o in orders)


def _interleaved(p: int, m: int, r: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B, in our words: virtual micro-batch k (0 <= k < m v) is chunk
    (k // p) % v of micro-batch (k // (p v)) p + k % p; backwards visit the chunks in reverse."""
    total = m * v

    def forward(k: int) -> Action:
        local = (k // p) % v
        return Action("F", local * p + r, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        local = v - 1 - (k // p) % v
        return Action("B", local * p + r, (k // (p * v)) * p + k % p)

    warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def with_communication(order: list[Action], stages: int, chunks: int = 1) -> list[Action]:
    """`order` with the point-to-point actions it implies: RECV_F before a forward that is not the
    first chunk, SEND_F after one that is not the last; RECV_B before a backward (B or I) that is not
    the last chunk, SEND_B after one that is not the first."""
    last = stages * chunks - 1
    program: list[Action] = []
    for action in order:
        c, mb = action.chunk, action.mb
        if action.kind == "F":
            if c > 0:
                program.append(Action("RECV_F", c, mb))
            program.append(action)
            if c < last:
                program.append(Action("SEND_F", c, mb))
        elif action.kind in ("B", "I"):
            if c < last:
                program.append(Action("RECV_B", c, mb))
            program.append(action)
            if c > 0:
                program.append(Action("SEND_B", c, mb))
        else:
            program.append(action)
    return program


def program(name: str, stages: int, microbatches: int, rank: int, chunks: int = 1) -> list[Action]:
    """The whole program of one rank: compute actions and the communication they imply."""
    return with_communication(compute_order(name, stages, microbatches, rank, chunks), stages, chunks)

