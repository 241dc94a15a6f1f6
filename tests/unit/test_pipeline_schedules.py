"""Pipeline schedules as data, checked by the simulator without processes."""

from __future__ import annotations

import pytest

from paratrain.config.parallel import ScheduleError, check_schedule
from paratrain.pipeline.schedules import Action, Schedule, program
from paratrain.pipeline.simulate import simulate

CASES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 16)]


def _run(name: str, p: int, m: int, v: int = 1):
    return simulate([program(name, p, m, r, v) for r in range(p)], Schedule(name, p, v), microbatches=m)


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


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if m >= p > 1])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (0.6, 1.2, 1.9)])
def test_zero_bubble_idles_f_plus_i_per_stage_boundary(p, m, f, i, w):
    """With 1F1B's per-stage memory bound, each rank idles (p - 1)(F + I): 1F1B's (p - 1)(F + I + W)
    less the weight gradients moved into it (the order is built with equal costs and holds for others)."""
    costs = {"F": f, "I": i, "W": w, "B": i + w}
    sim = simulate([program("zero-bubble", p, m, r) for r in range(p)], Schedule("zero-bubble", p), microbatches=m,
                   costs=costs)
    assert sim.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i), abs=1e-9)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if m >= p > 1])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (0.6, 1.2, 1.5), (1.0, 1.0, 0.2)])
def test_zb_h1_idles_f_plus_i_less_w_per_stage_boundary_holding_p_micro_batches(p, m, f, i, w):
    """Qi et al.'s ZB-H1 bound: each rank idles (p - 1)(F + I - W) when W <= F and W <= I (half 1F1B's idle with equal
    passes), (p - 1)(F + I - min(F, I, W)) in general (a W longer than the F or I beside it overhangs by the
    difference); every rank holds at most p micro-batches (activations, or the inputs of a W still to run): 1F1B's
    first stage."""
    costs = {"F": f, "I": i, "W": w, "B": i + w}
    schedule = Schedule("zb-h1", p)
    sim = simulate([schedule.program(r, m) for r in range(p)], schedule, microbatches=m, costs=costs)
    assert sim.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - min(f, i, w)), abs=1e-9)
    assert sim.peak_in_flight == (p,) * p
    assert all({a.kind for a in schedule.order(r, m)} == {"F", "I", "W"} for r in range(p))
    unit = simulate([schedule.program(r, m) for r in range(p)], schedule, microbatches=m)
    assert unit.bubble_fraction == pytest.approx(schedule.bubble(m), abs=1e-12)


def _executor_costs(p: int, m: int, chunks: int, unit: float) -> list[dict[tuple[str, int, int], float]]:
    """Each pass `unit` long, but chunk 0's I empty and its W the whole backward (its input, the token ids, has no
    gradient): how paratrain's executor runs a split backward."""
    return [{(k, c, mb): 0.0 if (c, k) == (0, "I") else 2 * unit if (c, k) == (0, "W") else unit
             for k in "FIW" for c in range(p * chunks) for mb in range(m)}] * p


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 3 * p, 4 * p, 8 * p)])
def test_dualpipev_runs_its_eight_phases_and_idles_least(p, m):
    """DualPipeV (the V of ZB-V, eight handcrafted phases): every chunk's F once and B or I and W once per micro-batch,
    messages matched in order on every pair (the simulator checks); with chunk 0 priced as the executor runs it, its
    bubble is the simulated one (Schedule.bubble) and at most ZB-V's (p - 1 passes idle: 1 at p 2, 3 at p 4, 7 at
    p 8 with m 16; ZB-V 2, 3, 11); every rank holds 2p + 1 micro-batch chunks at most (one more than ZB-V: the steady state's
    forward runs before the backward beside it). m < 2p is refused with the rule."""
    schedule = Schedule("dualpipev", p, 2)
    costs = [{(k, c, mb): (0.0 if (c, k) == (0, "I") else 2.0 if k == "B" or (c, k) == (0, "W") else 1.0)
              for k in "FBIW" for c in range(2 * p) for mb in range(m)}] * p
    sim = simulate([schedule.program(r, m) for r in range(p)], schedule, microbatches=m, durations=costs)
    assert sim.bubble_fraction == pytest.approx(schedule.bubble(m), abs=1e-12)
    assert schedule.bubble(m) <= Schedule("zb-v", p, 2).bubble(m) + 1e-12
    assert max(sim.peak_in_flight) <= 2 * p + 1
    with pytest.raises(ScheduleError, match=rf"micro-batches \({p}\) < {2 * p}; raise global_batch"):
        check_schedule("dualpipev", p, p, 2)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in CASES if p > 1])
def test_zb_v_idles_less_than_zb_h1_at_the_first_stages_memory(p, m):
    """ZB-V, two chunks a rank in a V (rank r holds chunks r and 2p - 1 - r: rank 0 the first and the last), I and W
    apart, list-scheduled with equal passes and chunk 0 priced as the executor runs it: its bubble is the simulated
    one (Schedule.bubble); every rank holds at most 2p micro-batch chunks (p whole stages: 1F1B's first-stage peak),
    exactly that once m >= p; with m >= p it idles at most ZB-H1's time at the same costs (p - 1 chunk passes, half
    ZB-H1's, at p 4 with m 4, 8 and 16 and at p 8 with m 8; 4 at p 4 with m 5); messages match in order on every
    pair (the simulator checks)."""
    schedule = Schedule("zb-v", p, 2)
    assert [schedule.chunks_of(r) for r in range(p)] == [[r, 2 * p - 1 - r] for r in range(p)]
    sim = simulate([schedule.program(r, m) for r in range(p)], schedule, microbatches=m,
                   durations=_executor_costs(p, m, 2, 1.0))
    assert sim.bubble_fraction == pytest.approx(schedule.bubble(m), abs=1e-12)
    assert max(sim.peak_in_flight) <= 2 * p
    if m >= p:
        assert sim.peak_in_flight == (2 * p,) * p
        zb_h1 = Schedule("zb-h1", p)
        h1 = simulate([zb_h1.program(r, m) for r in range(p)], zb_h1, microbatches=m,
                      durations=_executor_costs(p, m, 1, 2.0))
        assert sim.makespan <= h1.makespan
        if (p, m) in ((4, 4), (4, 8), (4, 16), (8, 8)):
            assert sim.makespan - 6 * m == p - 1 == (h1.makespan - 6 * m) / 2


def test_replay_with_measured_durations_and_latency():
    """durations replace the per-kind costs action by action; latency delays every message."""
    p, m = 2, 4
    programs = [program("1f1b", p, m, r) for r in range(p)]
    uniform = [{(k, c, mb): cost for k, cost in (("F", 1.0), ("B", 2.0)) for c in range(p) for mb in range(m)}] * p
    base = simulate(programs, Schedule("1f1b", p), microbatches=m, durations=uniform)
    assert base.makespan == simulate(programs, Schedule("1f1b", p), microbatches=m).makespan == 15.0
    slow = [dict(uniform[0]), uniform[1]]
    slow[0][("B", 0, 3)] = 5.0  # the last backward of stage 0 is on the critical path
    assert simulate(programs, Schedule("1f1b", p), microbatches=m, durations=slow).makespan == 18.0
    # 1F1B at p = 2 has no slack: worked by hand, its critical path crosses the stage boundary m times
    assert simulate(programs, Schedule("1f1b", p), microbatches=m, latency=0.1).makespan == pytest.approx(15.0 + 0.1 * m)
    with pytest.raises(ScheduleError, match="durations for 1 ranks, 2 stages"):
        simulate(programs, Schedule("1f1b", p), microbatches=m, durations=uniform[:1])


def test_invalid_schedules_are_refused_with_the_reason():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) must be a multiple of it; use 4 or 8"):
        check_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="needs --virtual-stages >= 2"):
        check_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match="--virtual-stages 2 needs the interleaved schedule"):
        check_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        check_schedule("pipedream", 4, 8)
    with pytest.raises(ScheduleError, match=r"micro-batches \(3\) < pp; raise global_batch / \(micro_batch x dp\)"):
        check_schedule("zb-h1", 4, 3)
    with pytest.raises(ScheduleError, match=r"zb-v places 2 chunks on each pipeline rank in a V, so virtual_stages is "
                                            r"2 \(implied: leave --virtual-stages out\); got 3"):
        check_schedule("zb-v", 4, 8, 3)
    from paratrain.config.parallel import ParallelConfig

    assert ParallelConfig(pp=2, schedule="zb-v").resolved(2).virtual_stages == 2


def test_simulator_finds_deadlocks_and_misordered_messages():
    # both ranks first wait for the other's message: a deadlock
    a = [Action("RECV_B", 0, 0), Action("F", 0, 0), Action("SEND_F", 0, 0), Action("B", 0, 0)]
    b = [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0), Action("SEND_B", 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([a, b], Schedule("1f1b", 2), microbatches=1)
    # activations of micro-batches 0 and 1 sent in one order and received in the other
    good = program("gpipe", 2, 2, 1)
    swapped = [good[2], good[3], good[0], good[1], *good[4:]]  # RECV_F1.1, F1.1 first
    with pytest.raises(ScheduleError, match="match in order"):
        simulate([program("gpipe", 2, 2, 0), swapped], Schedule("gpipe", 2), microbatches=2)
    # a backward before its forward
    with pytest.raises(ScheduleError, match="comes before F0.0"):
        simulate([[Action("B", 0, 0), Action("F", 0, 0)]], Schedule("1f1b", 1), microbatches=1)


def test_timeline_measures_replays_and_traces_a_step():
    """A hand-made 1F1B step at p = 2, m = 1: rank 1 waits for the activation, rank 0 for the gradient."""
    from paratrain.pipeline.runtime import StepTimes
    from paratrain.pipeline.timeline import chrome_trace, measured_bubble, replay

    rank0 = StepTimes(compute=3.0, total=6.5, events=(("F", 0, 0, 0.0, 1.0), ("WAIT_B", 0, 0, 1.0, 4.5),
                                                      ("B", 0, 0, 4.5, 6.5)))
    rank1 = StepTimes(compute=3.0, total=4.5, events=(("WAIT_F", 1, 0, 0.0, 1.5), ("F", 1, 0, 1.5, 2.5),
                                                      ("B", 1, 0, 2.5, 4.5)))
    assert measured_bubble([rank0, rank1]) == pytest.approx(1 - 6.0 / (2 * 6.5))
    sim = replay([rank0, rank1], "1f1b", microbatches=1)
    assert sim.makespan == pytest.approx(6.0)  # the same actions with free messages
    assert replay([rank0, rank1], "1f1b", microbatches=1, latency=0.25).makespan == pytest.approx(6.5)
    trace = chrome_trace([rank0, rank1])["traceEvents"]
    assert [(e["tid"], e["name"], e["cat"]) for e in trace[:2]] == [(0, "F 0.0", "compute"), (0, "WAIT_B 0.0", "wait")]
    assert trace[-1]["ts"] == pytest.approx(2.5e6) and trace[-1]["dur"] == pytest.approx(2e6)
