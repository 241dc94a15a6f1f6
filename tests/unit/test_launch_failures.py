"""The launcher's final message names the root cause first: the rank that failed first and how."""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from paratrain.launch.local import JobFailed, _failures


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
    failures = _failures(error)
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
    failures = _failures(error)
    assert [f.rank for f in failures] == [1, 3, 0, 2]
    assert failures[0].how == "died of SIGSEGV (signal 11)" and failures[0].message == "no error of its own: a crash"
    assert failures[-1].how == "was stopped by the launcher (SIGTERM)"
