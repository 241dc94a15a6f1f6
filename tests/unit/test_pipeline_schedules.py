"""Pipeline schedules as data, checked by the simulator without processes."""

from __future__ import annotations

import pytest

from paratrain.pipeline.schedules import Action, ScheduleError, check_schedule, program
from paratrain.pipeline.simulate import simulate

CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def _run(name: str, p: int, m: int, v: int = 1):
    return simulate([program(name, p, m, r, v) for r in range(p)], stages=p, microbatches=m, chunks=v)


@pytest.mark.parametrize("p,m", CASES)
def test_gpipe_and_1f1b_bubble_and_memory(p, m):
    """Bubble (p - 1) / (m + p - 1) of the total time for both (Narayanan et al. 2021, eq. 1);
    in flight: GPipe m micro-batches on every rank, 1F1B min(p - r, m)."""
    for name in ("gpipe", "1f1b"):
        sim = _run(name, p, m)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), name
    assert _run("gpipe", p, m).peak_in_flight == (m,) * p
    assert _run("1f1b", p, m).peak_in_flight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved_bubble_and_memory(p, v, groups):
    """Bubble (p - 1) / (v m) of the ideal time; rank r holds at most min(2 (p - r - 1) + (v - 1) p + 1,
    v m) chunk activations (Megatron-LM's warm-up plus one)."""
    m = groups * p
    sim = _run("interleaved", p, m, v)
    assert sim.bubble_over_ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)
    expected = tuple(v * m if m == p else min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p))
    assert sim.peak_in_flight == expected


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if p > 1 and m > 1])
def test_zero_bubble_beats_1f1b_with_its_memory(p, m):
    zb, base = _run("zero-bubble", p, m), _run("1f1b", p, m)
    assert zb.makespan < base.makespan
    assert zb.peak_in_flight == base.peak_in_flight  # I frees nothing, W does: the 1F1B bound holds
    assert all("B" not in {a.kind for a in program("zero-bubble", p, m, r)} for r in range(p))


def test_invalid_schedules_are_refused_with_the_reason():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) must be a multiple of it; use 4 or 8"):
        check_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="needs --virtual-stages >= 2"):
        check_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match="--virtual-stages 2 needs the interleaved schedule"):
        check_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        check_schedule("pipedream", 4, 8)


def test_simulator_finds_deadlocks_and_misordered_messages():
    # both ranks first wait for the other's message: a deadlock
    a = [Action("RECV_B", 0, 0), Action("F", 0, 0), Action("SEND_F", 0, 0), Action("B", 0, 0)]
    b = [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([a, b], stages=2, microbatches=1)
    # activations of micro-batches 0 and 1 sent in one order and received in the other
    good = program("gpipe", 2, 2, 1)
    swapped = [good[2], good[3], good[0], good[1], *good[4:]]  # RECV_F1.1, F1.1 first
    with pytest.raises(ScheduleError, match="match in order"):
        simulate([program("gpipe", 2, 2, 0), swapped], stages=2, microbatches=2)
    # a backward before its forward
    with pytest.raises(ScheduleError, match="comes before F0.0"):
        simulate([[Action("B", 0, 0), Action("F", 0, 0)]], stages=1, microbatches=1)
