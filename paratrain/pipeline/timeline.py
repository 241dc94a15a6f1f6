"""A pipeline step as it ran: each rank's timeline (paratrain.pipeline.runtime.StepTimes), its measured
bubble, the same step replayed in the simulator, and a Chrome trace of it.

The replay runs the schedule with each action's measured duration and free (or fixed-latency)
messages: the bubble this step would have had if communication and the executor cost nothing. The
difference between the measured and the replayed bubble is what the runtime adds (message latency,
Python between actions); the difference between the replay and the formula is the stages' inequality
and the compute's own jitter.
"""

from __future__ import annotations

from collections.abc import Sequence

from paratrain.pipeline.runtime import StepTimes
from paratrain.pipeline.schedules import Schedule
from paratrain.pipeline.simulate import Simulation, simulate


def measured_bubble(times: Sequence[StepTimes]) -> float:
    """Idle share of all ranks' time in one step: 1 - sum of compute / (p x the longest rank's step)."""
    return 1.0 - sum(t.compute for t in times) / (len(times) * max(t.total for t in times))


def replay(times: Sequence[StepTimes], schedule: str, *, microbatches: int, chunks: int = 1,
           latency: float = 0.0) -> Simulation:
    """The simulator on the programs of every rank (times in rank order) with each compute action's
    measured duration."""
    stages = len(times)
    durations = [{(k, c, mb): end - start for k, c, mb, start, end in t.events if not k.startswith("WAIT")}
                 for t in times]
    plan = Schedule(schedule, stages, chunks)
    programs = [plan.program(r, microbatches) for r in range(stages)]
    return simulate(programs, plan, microbatches=microbatches, durations=durations, latency=latency)


def chrome_trace(times: Sequence[StepTimes]) -> dict:
    """The step as Chrome's trace format (chrome://tracing, ui.perfetto.dev): one row per pipeline rank,
    compute actions and receive waits as spans, in microseconds from each rank's start of the step."""
    events = []
    for rank, t in enumerate(times):
        for kind, chunk, mb, start, end in t.events:
            events.append({"name": f"{kind} {chunk}.{mb}", "cat": "wait" if kind.startswith("WAIT") else "compute",
                           "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": 0, "tid": rank,
                           "args": {"chunk": chunk, "microbatch": mb}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
