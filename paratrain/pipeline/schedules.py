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
- zb-v (Qi et al. 2024, ZB-V): two chunks a rank in a V (rank r holds chunks r and 2p - 1 - r, so rank 0 holds
  the embedding and the loss), I and W apart, list-scheduled (paratrain.pipeline.zero_bubble) with at most 2p
  micro-batch chunks held a rank: p whole stages' activations, 1F1B's first-stage peak, on every rank; it idles
  at most ZB-H1's time (half at p 4; Schedule.bubble). The hand-off between chunks p - 1 and p stays on rank p - 1
  (a send to itself: paratrain.pipeline.p2p).
- dualpipev (DeepSeek's DualPipeV): ZB-V's V in eight handcrafted phases (zero_bubble.dualpipev_order), each
  steady-state forward beside a whole backward of the other chunk, I and W apart at the ends; m >= 2p.
- zb-h1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1 as handcrafted there): 1F1B with the
  backward split into I and W, rank r deferring its W passes by r micro-batches, so that W fills the bubble
  1F1B leaves at the start of later stages and the tail of earlier ones. Each rank idles (p - 1)(F + I - W)
  when W <= F and W <= I (m >= p; in general (p - 1)(F + I - min(F, I, W))) and holds at most p micro-batches'
  activations or weight-gradient inputs: the first stage's 1F1B peak, on every stage.

`Schedule` is the one object the executor (paratrain.pipeline.runtime), the simulator, the point-to-point
exchange and the planner read: which rank holds each chunk, each rank's program, whether the backward is split
into I and W, and the bubble. Nothing outside this file branches on a schedule's name; a new schedule is a new
entry here, its name and rules in paratrain.config.parallel, and its test.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from paratrain.config.parallel import ScheduleError, check_schedule  # the names and rules: config; the programs: here
from paratrain.pipeline.zero_bubble import dualpipev_order, dualpipev_span, list_schedule, v_placement

COMPUTE = ("F", "B", "I", "W")


class Action(NamedTuple):
    kind: str
    """F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B."""
    chunk: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


SPLIT_BACKWARD = frozenset({"zero-bubble", "zb-h1", "zb-v", "dualpipev"})
"""The schedules whose backward runs as I (input gradient) and W (weight gradient) apart (dualpipev: some)."""

V_SHAPED = frozenset({"zb-v", "dualpipev"})
"""The schedules placing two chunks a rank in a V (paratrain.pipeline.zero_bubble.v_placement)."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule over `stages` ranks and `chunks` model chunks a rank (stages x chunks in all)."""

    name: str
    stages: int
    chunks: int = 1

    def __post_init__(self) -> None:
        # the rules that do not depend on the micro-batch count (2 x stages micro-batches satisfy those that do)
        check_schedule(self.name, self.stages, 2 * self.stages, self.chunks)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as I and W apart (a W keeps the chunk's weight-gradient inputs)."""
        return self.name in SPLIT_BACKWARD

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding chunk `chunk` (0 .. stages x chunks - 1): chunk c on rank c % p, or in a V
        (c on rank c for c < p, on 2p - 1 - c after)."""
        if self.name in V_SHAPED:
            return v_placement(self.stages)[chunk]
        return chunk % self.stages

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks rank `rank` holds, in model order."""
        return list(_chunks_of(self, rank))

    def order(self, rank: int, microbatches: int) -> list[Action]:
        """The compute actions of `rank`, in the order it runs them."""
        return compute_order(self.name, self.stages, microbatches, rank, self.chunks)

    def program(self, rank: int, microbatches: int) -> list[Action]:
        """The whole program of `rank`: compute actions and the communication they imply."""
        return list(_programs(self.name, self.stages, self.chunks, microbatches)[rank])

    def peer(self, action: Action) -> int:
        """The pipeline rank a send goes to, or a receive comes from: the rank of the chunk after (forward) or
        before (backward) the action's."""
        return self.rank_of(action.chunk + _STEP[action.kind])

    def peak_microbatches(self, microbatches: int) -> int:
        """A micro-batch count whose programs reach every rank's peak of saved activations (chunk by chunk) as
        `microbatches` do: itself, or for a V schedule at most 4p (its steady state repeats; checked to p = 16), so
        that a planner does not list-schedule thousands of micro-batches."""
        return min(microbatches, 4 * self.stages) if self.name in V_SHAPED else microbatches

    def bubble(self, microbatches: int) -> float:
        """Idle share of a step (idle over total time per rank) with equal stages: gpipe, 1f1b (p - 1) / (m + p - 1);
        interleaved (p - 1) / (v m + p - 1) (the bubble is (p - 1) / (v m) of the ideal time); zero-bubble as
        paratrain schedules it, with F = I = W: each rank idles (p - 1)(F + I) against m (F + I + W) of work,
        2 (p - 1) / (3 m + 2 (p - 1)); zb-h1 idles (p - 1)(F + I - W), (p - 1) / (3 m + p - 1); zb-v and dualpipev
        their simulated spans, chunk passes of 1 but chunk 0's I empty and its W 2 (as the executor runs them): zb-v
        idles 2, 3, 11 passes a rank at p 2, 4, 8 (m 16; ZB-H1 14), dualpipev p - 1; past 4p micro-batches each adds
        its 6 passes to the span."""
        p, m, v = self.stages, microbatches, self.chunks
        if m < 1:
            raise ValueError(f"micro-batches must be >= 1, got {m}")
        if self.name == "interleaved":
            return (p - 1) / (v * m + p - 1)
        if self.name == "zb-h1":
            return (p - 1) / (3.0 * m + p - 1)
        if self.name in V_SHAPED:  # each rank 6m chunk actions of 1; past 4p micro-batches each adds its 6 to the span
            ref = self.peak_microbatches(m)
            span = dualpipev_span(p, ref) if self.name == "dualpipev" else list_schedule(
                v_placement(p), (2 * p,) * p, ref, empty_first_i=True)[1]
            return 1.0 - 6.0 * m / (span + 6.0 * (m - ref))
        if self.splits_backward:
            return 2.0 * (p - 1) / (3.0 * m + 2.0 * (p - 1))
        return (p - 1) / (m + p - 1)


@functools.lru_cache(maxsize=4096)
def _chunks_of(schedule: Schedule, rank: int) -> tuple[int, ...]:
    return tuple(c for c in range(schedule.stages * schedule.chunks) if schedule.rank_of(c) == rank)


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
    if name == "zero-bubble":  # 1F1B's in-flight bound, p - r
        return [Action(*a) for a in list_schedule(tuple(range(p)), tuple(p - s for s in range(p)), m)[0][r]]
    if name == "zb-v":  # two chunks a rank in a V, at most 2p micro-batch chunks held
        return [Action(*a) for a in list_schedule(v_placement(p), (2 * p,) * p, m, empty_first_i=True)[0][r]]
    if name == "dualpipev":
        return [Action(*a) for a in dualpipev_order(p, m, r)]
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
    return list(_programs(name, stages, chunks, microbatches)[rank])


@functools.lru_cache(maxsize=64)
def _programs(name: str, stages: int, chunks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's program, receives in their senders' order (in_send_order)."""
    schedule = Schedule(name, stages, chunks)
    programs = [with_communication(compute_order(name, stages, microbatches, r, chunks), stages, chunks)
                for r in range(stages)]
    return tuple(tuple(p) for p in in_send_order(programs, schedule))


def in_send_order(programs: list[list[Action]], schedule: Schedule) -> list[list[Action]]:
    """The programs with each receive from another rank taken in the order its sender sends: point-to-point messages
    between two ranks match in order (NCCL), and when one pair carries two streams (a V schedule: activations of the
    first leg and gradients of the second run the same way) a receiver's compute may want them in another order. A
    receive that comes before messages sent earlier on its pair takes those first (they have been sent by the time
    it arrives, so no wait is added, and nothing can deadlock that did not); hand-offs within a rank stay local."""
    sent: dict[tuple[int, int], list[Action]] = {}
    for rank, prog in enumerate(programs):
        for a in prog:
            if a.kind.startswith("SEND") and schedule.peer(a) != rank:
                receive = Action("RECV_" + a.kind[-1], a.chunk + _STEP[a.kind], a.mb)  # what the peer's RECV reads
                sent.setdefault((rank, schedule.peer(a)), []).append(receive)
    ordered = []
    for rank, prog in enumerate(programs):
        taken: dict[int, int] = {}
        done: set[Action] = set()
        out: list[Action] = []
        for a in prog:
            source = schedule.peer(a) if a.kind.startswith("RECV") else rank
            if source == rank:
                out.append(a)
                continue
            queue = sent[(source, rank)]
            while a not in done:
                earlier = queue[taken.get(source, 0)]
                taken[source] = taken.get(source, 0) + 1
                done.add(earlier)
                out.append(earlier)
        ordered.append(out)
    return ordered
