"""The zero-bubble schedules' programs, found by list scheduling in simulated time (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism"): the backward split into I (the input gradient, on the critical path) and W (the weight
gradient, deferred into what would be idle time).

`list_schedule` places the model's V chunks ("virtual stages" 0 .. V - 1, data flowing from each to the next) on
the pipeline ranks by `placement` and, with F = I = W = 1, gives every rank its compute order: whenever a rank is
free it runs, in this priority,

    I   the next input gradient of one of its chunks whose upstream gradient has arrived (the last chunk: after
        its own forward), the oldest micro-batch first, the later chunk on a tie;
    F   the next forward of one of its chunks whose input has arrived, if the rank holds fewer than its bound of
        micro-batch chunks (forward done, W not yet), the oldest micro-batch first, the later chunk on a tie;
    W   the oldest pending weight gradient;

otherwise it waits for the next event. paratrain.pipeline.schedules uses it for

    zero-bubble   V = p, chunk c on rank c, bound p - r (1F1B's in-flight bound): each rank idles (p - 1)(F + I)
    zb-v          V = 2p in a V: chunk c on rank c for c < p, on rank 2p - 1 - c after, so rank 0 holds the first
                  and the last chunk; bound 2p chunks (p whole stages' activations: 1F1B's first-stage peak, on
                  every rank); chunk 0 priced as the executor runs it (I empty, W the whole backward). Its bubble
                  is the span this gives (Schedule.bubble): greedy, not optimal (p - 1 passes idle at p 4, 11 at
                  p 8 with 16 micro-batches where p - 1 = 7 would be zero bubble's ideal)
"""

from __future__ import annotations

import functools
import heapq

from paratrain.config.parallel import ScheduleError


Orders = tuple[tuple[tuple[str, int, int], ...], ...]
"""Each rank's compute order: (kind, chunk, micro-batch) tuples."""


@functools.lru_cache(maxsize=64)
def list_schedule(placement: tuple[int, ...], bounds: tuple[int, ...], microbatches: int, *,
                  empty_first_i: bool = False) -> tuple[Orders, float]:
    """(each rank's compute order, the makespan with F = I = W = 1) for chunks placed on ranks by `placement` (chunk
    c on rank placement[c]) and at most bounds[r] micro-batch chunks held on rank r (module docstring).
    empty_first_i: price chunk 0 as the executor runs it, I = 0 and W = 2 (its input, the token ids, has no gradient:
    its W is the whole backward)."""
    ranks, chunks, m = len(bounds), len(placement), microbatches
    mine = [tuple(c for c in range(chunks) if placement[c] == r) for r in range(ranks)]
    done_f: list[dict[int, float]] = [{} for _ in range(chunks)]  # chunk -> micro-batch -> finish time
    done_i: list[dict[int, float]] = [{} for _ in range(chunks)]
    next_f, next_i = [0] * chunks, [0] * chunks
    pending_w: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]
    held, free = [0] * ranks, [0.0] * ranks
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]

    def choose(r: int, t: float) -> tuple[str, int, int] | None:
        def ready(finish: dict[int, float], mb: int) -> bool:
            return mb in finish and finish[mb] <= t

        backward = [(next_i[c], -c) for c in mine[r] if next_i[c] < next_f[c] and (
            ready(done_f[c], next_i[c]) if c == chunks - 1 else ready(done_i[c + 1], next_i[c]))]
        if backward:
            mb, c = min(backward)
            return ("I", -c, mb)
        forward = [(next_f[c], -c) for c in mine[r] if held[r] < bounds[r] and next_f[c] < m and (
            c == 0 or ready(done_f[c - 1], next_f[c]))]
        if forward:
            mb, c = min(forward)
            return ("F", -c, mb)
        return pending_w[r][0] if pending_w[r] else None

    left = [3 * m * len(mine[r]) for r in range(ranks)]
    # Every pass takes whole units (1; chunk 0's I 0 and W 2 when so priced), so ranks act at whole times: the heap
    # holds (the time a rank is next free, the rank), ranks free at the same time in rank order; a rank with nothing
    # to run tries again a unit later (nothing it waits for can finish in between)
    ready_at = [(0, r) for r in range(ranks) if left[r]]
    while ready_at:
        t, r = heapq.heappop(ready_at)
        action = choose(r, t)
        if action is None:
            if t > 6 * m * chunks + chunks:  # far past any schedule's end: something can never run
                raise ScheduleError(f"zero-bubble list scheduling is stuck with placement {placement}, "
                                    f"{m} micro-batches")
            heapq.heappush(ready_at, (t + 1, r))
            continue
        kind, c, mb = action
        cost = 1 if not (empty_first_i and c == 0 and kind != "F") else (0 if kind == "I" else 2)
        if kind == "I":
            done_i[c][mb] = t + cost
            next_i[c] += 1
            pending_w[r].append(("W", c, mb))
        elif kind == "F":
            done_f[c][mb] = t + cost
            next_f[c] += 1
            held[r] += 1
        else:
            pending_w[r].pop(0)
            held[r] -= 1
        orders[r].append((kind, c, mb))
        free[r] = t + cost
        left[r] -= 1
        if left[r]:
            heapq.heappush(ready_at, (t + cost, r))
    return tuple(tuple(o) for o in orders), float(max(free))


@functools.lru_cache(maxsize=256)
def v_placement(stages: int) -> tuple[int, ...]:
    """Chunk c of 2 x stages on rank c for c < stages, on rank 2 stages - 1 - c after: a V."""
    return tuple(c if c < stages else 2 * stages - 1 - c for c in range(2 * stages))


def dualpipev_order(stages: int, microbatches: int, rank: int) -> tuple[tuple[str, int, int], ...]:
    """DualPipeV's compute order for `rank` (DeepSeek-AI's DualPipe repository, dualpipev.py: DualPipe "cut in
    half", two chunks a rank in a V), in eight phases; the rank's chunk 0 is stage `rank` on the way down, its
    chunk 1 stage 2p - 1 - rank on the way back (v_placement):

        1  2 (p - r - 1) F0             warm-up down the V
        2  r + 1 (F0 F1)                reach the turn
        3  p - r - 1 (I1 W F1)          zero bubble on the way back
        4  m - 2p + r + 1 (F0 B1 F1 B0) the steady state: each forward beside a whole backward of the other chunk
        5  p - r - 1 (B1 F1 B0)
        6  r + 1 (B1 B0)                the second half of them split into I and W
        7  p - r - 1 (W I0)
        8  r + 1 W                      the deferred weight gradients

    W runs the oldest deferred weight gradient. DualPipe computes each "F B" pair of phases 4 and 5 at once (the
    forward's compute beside the backward's communication, the all-to-alls of expert parallelism hidden); this
    executor runs them one after the other. Needs m >= 2p (config.parallel.check_schedule)."""
    p, m, r = stages, microbatches, rank
    down, back = r, 2 * p - 1 - r
    chunk = (down, back)
    next_f, next_b = [0, 0], [0, 0]
    deferred: list[tuple[str, int, int]] = []
    order: list[tuple[str, int, int]] = []

    def forward(phase: int) -> None:
        order.append(("F", chunk[phase], next_f[phase]))
        next_f[phase] += 1

    def backward(phase: int, split: bool = False) -> None:
        action = (chunk[phase], next_b[phase])
        order.append(("I" if split else "B", *action))
        if split:
            deferred.append(("W", *action))
        next_b[phase] += 1

    def weight() -> None:
        order.append(deferred.pop(0))

    for _ in range(2 * (p - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0), forward(1)
    for _ in range(p - r - 1):
        backward(1, split=True), weight(), forward(1)
    for _ in range(m - 2 * p + r + 1):
        forward(0), backward(1), forward(1), backward(0)
    for _ in range(p - r - 1):
        backward(1), forward(1), backward(0)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(p - r - 1):
        weight(), backward(0, split=True)
    for _ in range(r + 1):
        weight()
    return tuple(order)


@functools.lru_cache(maxsize=256)
def dualpipev_span(stages: int, microbatches: int) -> float:
    """DualPipeV's makespan in chunk passes (v_span)."""
    return v_span(tuple(dualpipev_order(stages, microbatches, r) for r in range(stages)), 2 * stages)


def v_span(orders: tuple[tuple[tuple[str, int, int], ...], ...], chunks: int) -> float:
    """The makespan of every rank's compute order run in order, communication free, each pass 1 (B 2) but chunk 0's I
    0 and W 2 (as the executor runs them): F(c) after F(c - 1) of its micro-batch, I or B (c) after I or B (c + 1) (the
    last chunk: after its own F), W after its I. (paratrain.pipeline.simulate runs whole programs; this needs none.)"""
    done: dict[tuple[str, int, int], float] = {}
    clock, at = [0.0] * len(orders), [0] * len(orders)
    while any(at[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, c, mb = order[at[r]]
                need = (("F", c - 1, mb),) if kind == "F" and c else () if kind == "F" else (
                    (("I", c, mb),) if kind == "W" else (("F", c, mb),) if c == chunks - 1 else (("I", c + 1, mb),))
                if any(n not in done for n in need):
                    break
                cost = 2.0 if kind == "B" else {"I": 0.0, "W": 2.0}.get(kind, 1.0) if c == 0 else 1.0
                clock[r] = max([clock[r], *(done[n] for n in need)]) + cost
                done[(kind, c, mb)] = clock[r]
                if kind == "B":
                    done[("I", c, mb)] = clock[r]  # what the previous chunk waits for
                at[r] += 1
                moved = True
        if not moved:
            raise ScheduleError("a compute order waits on itself: no rank can move")
    return max(clock)
