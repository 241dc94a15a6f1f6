"""The launcher's final message names the root cause first: the rank that failed first and how."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from paratrain.launch.agent import _stop
from paratrain.launch.failures import SHUTDOWN_GRACE_S, JobFailed, failures_of, name_the_hang
from paratrain.topology.recorder import absent_ranks


def _failure(rank: int, exitcode: int, message: str = "", timestamp: int = 0) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")
    if message:
        failure.message, failure.timestamp = message, timestamp
    return failure


def test_a_killed_rank_comes_before_the_peers_it_broke():
    """kill -9 of rank 1: rank 0's all-reduce fails ("Connection closed by peer"), then the launcher
    stops rank 0 with SIGTERM. Rank 1 is the root cause, not rank 0 (what the old message said)."""
    error = ChildFailedError("paratrain", {
        0: _failure(0, -signal.SIGTERM, "CollectiveError: all_reduce of (2,) on the dp group (ranks [0, 1]) "
                                        "failed: Connection closed by peer", timestamp=5),
        1: _failure(1, -signal.SIGKILL),
    })
    failures = failures_of(error)
    assert [f.rank for f in failures] == [1, 0]
    text = str(JobFailed(failures))
    assert text.startswith("rank 1 died of SIGKILL (signal 9): killed from outside, or out of memory")
    assert "then: rank 0 raised (then stopped by the launcher: SIGTERM): CollectiveError" in text


def test_an_error_of_its_own_comes_before_collective_failures_and_cleanup():
    error = ChildFailedError("paratrain", {
        0: _failure(0, 1, "CollectiveError: broadcast ... failed", timestamp=2),
        2: _failure(2, -signal.SIGTERM),
        3: _failure(3, 1, "RuntimeError: injected fault (train.fail_at) on rank 3 at step 3", timestamp=3),
        1: _failure(1, -signal.SIGSEGV),
    })
    failures = failures_of(error)
    assert [f.rank for f in failures] == [1, 3, 0, 2]
    assert failures[0].how == "died of SIGSEGV (signal 11)" and failures[0].message == "no error of its own: a crash"
    assert failures[-1].how == "was stopped by the launcher (SIGTERM)"


TIMED_OUT = ("CollectiveError: all_reduce (#13 on this group) of (2,) torch.float32 on the dp group (ranks [0, 1]) "
             "failed on global rank 0: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
             "operation to complete. A peer may have crashed or be stuck in a different collective; check the other "
             "ranks' errors.")
"""What rank 0 of the launcher reported when rank 1 was SIGSTOPped (--timeout 5, gloo)."""


def _flight(folder: Path, *ranks_done: int) -> Path:
    """Flight records of a dp group of 2: rank 0 finished all_reduce #12 and failed in #13; each rank in
    ranks_done (also) left a record whose last collective is #12, done."""
    def entry(seq: int, state: str) -> dict:
        return {"axis": "dp", "ranks": [0, 1], "seq": seq, "op": "all_reduce", "shape": [2], "dtype": "float32",
                "state": state, "order": seq}

    (folder / "rank0.json").write_text(json.dumps({"rank": 0, "entries": [entry(12, "done"), entry(13, "failed")],
                                                   "stack": ""}))
    for rank in ranks_done:
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "entries": [entry(12, "done")],
                                                             "stack": "  File 'train.py', in step"}))
    return folder


def test_a_stopped_rank_the_launcher_had_to_kill_is_named_as_the_hang(tmp_path):
    """Rank 1 SIGSTOPped: rank 0 times out in all_reduce #13, the launcher SIGTERMs rank 1, which cannot
    run, and SIGKILLs it after the grace. That SIGKILL is the launcher's own: the first line names the
    hang (the old one said "rank 1 died of SIGKILL: killed from outside, or out of memory")."""
    error = ChildFailedError("paratrain", {0: _failure(0, 1, TIMED_OUT, timestamp=5), 1: _failure(1, -signal.SIGKILL)})
    failures = failures_of(error, {1: "T"})
    assert failures[-1].how == "was killed by the launcher (SIGKILL)" and failures[-1].stopped_by_launcher
    absent = absent_ranks(_flight(tmp_path))
    text = str(JobFailed(name_the_hang(failures, absent), [a.line() for a in absent]))
    first = text.splitlines()[0]
    assert first == ("rank 1 stopped responding: it never took part in all_reduce #13 on the dp group (ranks [0, 1]), "
                     f"where rank 0 waited; it did not leave within {SHUTDOWN_GRACE_S} s of the launcher's SIGTERM: it "
                     "was stopped (SIGSTOP, or a debugger), so the launcher killed it (SIGKILL)"), text
    assert "then: rank 0 raised: CollectiveError: all_reduce (#13 on this group)" in text
    assert "hang report: rank 1 left no record of all_reduce #13 on the dp group (ranks [0, 1])" in text


def test_a_hung_rank_that_left_its_record_is_named_from_it(tmp_path):
    """--fail-at 1:13:hang (a rank looping in Python): it answers the launcher's SIGTERM with its record,
    which says it never entered #13."""
    error = ChildFailedError("paratrain", {0: _failure(0, 1, TIMED_OUT, timestamp=5), 1: _failure(1, -signal.SIGTERM)})
    failures = name_the_hang(failures_of(error, {1: ""}), absent_ranks(_flight(tmp_path, 1)))
    assert [f.rank for f in failures] == [1, 0]
    assert str(JobFailed(failures)).splitlines()[0] == (
        "rank 1 stopped responding: it never entered all_reduce #13 on the dp group (ranks [0, 1]), where rank 0 "
        "waited; the launcher then stopped it (SIGTERM)")


def test_a_kill_from_outside_stays_the_root_cause_whatever_the_hang_report_says(tmp_path):
    """Rank 1 SIGKILLed before any timeout (not by the launcher: it had left when rank 0 failed): named
    first as a kill, as before. And where another rank was killed from outside, a rank the launcher
    stopped before it reached the collective is not blamed, even if the collective timed out."""
    absent = absent_ranks(_flight(tmp_path))
    error = ChildFailedError("paratrain", {
        0: _failure(0, -signal.SIGTERM, "CollectiveError: all_reduce (#13 on this group) ... failed: Connection closed "
                                        "by peer", timestamp=5),
        1: _failure(1, -signal.SIGKILL)})
    failures = name_the_hang(failures_of(error, {0: ""}), absent)
    assert str(JobFailed(failures)).startswith(
        "rank 1 died of SIGKILL (signal 9): killed from outside, or out of memory")
    error = ChildFailedError("paratrain", {0: _failure(0, 1, TIMED_OUT, timestamp=5), 1: _failure(1, -signal.SIGTERM),
                                           2: _failure(2, -signal.SIGKILL)})
    failures = name_the_hang(failures_of(error, {1: ""}), absent)
    assert [(f.rank, f.how) for f in failures] == [(2, "died of SIGKILL (signal 9)"), (0, "raised"),
                                                   (1, "was stopped by the launcher (SIGTERM)")]


def test_a_rank_the_launcher_killed_is_not_blamed_without_a_timeout(tmp_path):
    """No collective timed out (rank 0's peer connection closed): a rank the launcher had to SIGKILL is
    a consequence, after the collective's failure, whatever the report says of it."""
    error = ChildFailedError("paratrain", {
        0: _failure(0, 1, "CollectiveError: broadcast ... failed: Connection closed by peer", timestamp=5),
        1: _failure(1, -signal.SIGKILL)})
    failures = name_the_hang(failures_of(error, {1: "S"}), absent_ranks(_flight(tmp_path)))
    assert [f.rank for f in failures] == [0, 1]
    assert failures[1].message == (f"it did not leave within {SHUTDOWN_GRACE_S} s of the launcher's SIGTERM: it was "
                                   "stuck outside Python, where its SIGTERM handler cannot run (state S)")


WORKER = """
import os, signal, time
def leave(signum, frame):  # as paratrain's workers: (write the flight record,) then die of SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
signal.signal(signal.SIGTERM, leave)
print("ready", flush=True)
time.sleep(60)
"""
"""A process that handles SIGTERM in Python: stopped, its SIGTERM stays pending (a process stopped with
SIGTERM's default action would die of it at once)."""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_the_launcher_kills_what_cannot_run_after_the_grace_not_30_s(tmp_path):
    """GraceAgent's stop: a worker that honours SIGTERM leaves at once; a stopped one is SIGKILLed after
    the grace (torch waits 30 s), and its state says why it did not leave."""
    handlers = {rank: SubprocessHandler(entrypoint=sys.executable, args=("-c", WORKER), env={},
                                        stdout=str(tmp_path / f"out{rank}"), stderr=None, local_rank_id=rank,
                                        numa_options=None) for rank in (0, 1)}
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"out{rank}").read_text() for rank in handlers):  # its handler is in place
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(handlers[1].proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        stopped = _stop(handlers, grace_s=0.5)
        elapsed = time.monotonic() - started
    finally:
        for handler in handlers.values():
            handler.proc.kill()
            handler.proc.wait()
    assert stopped == {0: "", 1: "T"}
    assert handlers[0].proc.returncode == -signal.SIGTERM and handlers[1].proc.returncode == -signal.SIGKILL
    assert 0.5 <= elapsed < 3, elapsed


def test_an_error_file_cut_by_a_kill_is_dropped_not_parsed(tmp_path):
    """A worker killed while torch's @record wrote its error file leaves it empty or cut; torch's ProcessFailure
    would raise parsing it and take the agent down (seen in CI: a run with restarts left was not restarted).
    The agent drops such a file, so torch reports that worker by its exit code; a whole file stays."""
    from paratrain.launch.agent import _drop_unreadable

    whole, empty, cut, missing = (tmp_path / name for name in ("whole.json", "empty.json", "cut.json", "none.json"))
    whole.write_text(json.dumps({"message": {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "0"}}}))
    empty.write_text("")
    cut.write_text('{"message": {"mess')
    _drop_unreadable({0: str(whole), 1: str(empty), 2: str(cut), 3: str(missing)})
    assert whole.exists() and not empty.exists() and not cut.exists()
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=str(empty))
    assert failure.exitcode == -9 and "Signal 9" in failure.message


def test_a_poll_that_meets_a_cut_error_file_is_repeated_after_the_file_is_dropped():
    """A worker that exits with a cut error file between the agent's check and torch's poll makes torch's parser
    raise (a JSONDecodeError) before it changes any state: the agent drops the file and polls again, up to three
    times, and a poll that keeps raising is not swallowed."""
    from paratrain.launch.agent import _poll_past_cut_files

    calls, drops = [], []

    def poll_failing(times: int):
        def poll():
            calls.append(1)
            if len(calls) <= times:
                raise json.JSONDecodeError("cut", "", 0)
            return "result"
        return poll

    assert _poll_past_cut_files(poll_failing(2), lambda: drops.append(1)) == "result"
    assert len(calls) == 3 and len(drops) == 2
    calls.clear()
    with pytest.raises(ValueError):
        _poll_past_cut_files(poll_failing(3), lambda: None)
    assert len(calls) == 3
