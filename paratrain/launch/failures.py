"""What a failed job says: the root cause first (RankFailure, JobFailed), from what torch's elastic
agent reports (failures_of) and, for a hang, from the ranks' flight records (name_the_hang)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from paratrain.topology.recorder import Absent


SHUTDOWN_GRACE_S = 3
"""Once a rank has failed, how long the launcher gives the others to leave after its SIGTERM before it
SIGKILLs them. A rank that can run writes its flight record and leaves in well under a second; one that
cannot (stopped, stuck outside Python) never will, and torch's own 30 s only delayed the end of the job
and its report (a rank SIGSTOPped with --timeout 5: the job ended 37 s after the stop, now 10 s)."""

@dataclass(frozen=True)
class RankFailure:
    rank: int
    exitcode: int
    message: str
    how: str
    """How it ended, in words: "raised", "died of SIGKILL (signal 9)", "was stopped by the launcher (SIGTERM)",
    "was killed by the launcher (SIGKILL)", "stopped responding"."""
    stopped_by_launcher: bool = False
    """It was still running when another rank had failed, so the launcher ended it (SIGTERM, then SIGKILL
    after SHUTDOWN_GRACE_S): a consequence, unless it is the rank the others waited for."""
    role: str = ""
    """What the rank is when it is not a trainer: " (parameter server 1)"."""

    @property
    def named(self) -> str:
        return f"rank {self.rank}{self.role}"


def with_roles(failures: list[RankFailure], first_server: int) -> list[RankFailure]:
    """Dedicated parameter servers (world ranks from first_server on; 0: none) named as such."""
    if not first_server:
        return failures
    return [replace(f, role=f" (parameter server {f.rank - first_server})") if f.rank >= first_server else f
            for f in failures]


class JobFailed(RuntimeError):
    """The root cause first (the rank that failed first and how), then what that did to the others,
    then the hang report: ranks that never entered a collective their peers waited in."""

    def __init__(self, failures: list[RankFailure], hangs: list[str] | None = None, *, reason: str = "",
                 other_nodes: bool = False) -> None:
        """other_nodes: the job spans nodes, so a cause may lie outside this node's failures."""
        self.failures, self.hangs = failures, hangs or []
        if not failures:
            super().__init__(reason or "job failed")
            return
        first, rest = failures[0], failures[1:]
        text = f"{first.named} {first.how}: {first.message}"
        if other_nodes and all("CollectiveError" in f.message or f.how.startswith(_ENDED_BY_LAUNCHER)
                               for f in failures):
            text = ("no rank of this node failed first: its collectives lost a peer, so the cause is on another "
                    "node (its launcher's output says what; a node killed whole says nothing)\n" + text)
        if rest:
            then = "; ".join(f"{f.named} {f.how}: {short(f.message)}" for f in rest[:3])
            more = f"; and {len(rest) - 3} more" if len(rest) > 3 else ""
            text += f"\nthen: {then}{more}"
        if self.hangs:
            text += "\nhang report: " + "\n".join(self.hangs)
        super().__init__(text)


def short(message: str, limit: int = 160) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= limit else line[: limit - 3] + "..."


_ENDED_BY_LAUNCHER = ("was stopped by the launcher", "was killed by the launcher")
"""The start of RankFailure.how for a rank with no error of its own that the launcher ended."""

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
"""A collective's error that says it waited its whole timeout (gloo: "Timed out waiting 5000ms for
recv"; NCCL: "Watchdog caught collective operation timeout")."""


def failures_of(error: object, stopped: Mapping[int, str] | None = None) -> list[RankFailure]:
    """The failed ranks, root cause first. A rank that died of a signal with no error of its own
    (SIGKILL: killed from outside or out of memory; SIGSEGV, SIGABRT: crashed) comes first; then one
    that raised its own error; then the collectives that failed because a peer was gone; last the
    ranks the launcher ended once one had failed (SIGTERM, or SIGKILL after SHUTDOWN_GRACE_S). Within
    each, the earliest, then the lowest rank.

    stopped: the ranks the launcher ended because another had failed (paratrain.launch.agent's
    WorkersFailed.stopped): "" if it left after the SIGTERM, else its process state when SIGKILLed. A
    SIGKILL of a rank not named there came from outside."""
    stopped = stopped or {}
    failures = []
    for rank, failure in getattr(error, "failures", {}).items():
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        text = str(message or "").strip()
        signalled = failure.exitcode < 0
        name = failure.signal_name() if signalled else ""
        silent = signalled and (not text or text.startswith("Signal "))  # no error file of its own
        if silent and name == "SIGKILL" and rank in stopped:
            how = "was killed by the launcher (SIGKILL)"
            text = (f"it did not leave within {SHUTDOWN_GRACE_S} s of the launcher's SIGTERM: "
                    f"{_state_words(stopped[rank])}")
            order = 3
        elif silent:
            how = ("was stopped by the launcher (SIGTERM)" if name == "SIGTERM" else
                   f"died of {name} (signal {-failure.exitcode})")
            text = {"SIGTERM": "after another rank failed", "SIGKILL": "killed from outside, or out of memory"}.get(
                name, "no error of its own: a crash")
            order = 3 if name == "SIGTERM" else 0
        else:
            if not text or text.startswith("To enable traceback"):
                text = f"exited with code {failure.exitcode} (see its traceback above)"
            how = "raised" + (f" (then stopped by the launcher: {name})" if signalled else "")
            order = 2 if "CollectiveError" in text else 1
        failures.append((order, failure.timestamp, rank,
                         RankFailure(rank=rank, exitcode=failure.exitcode, message=text, how=how,
                                     stopped_by_launcher=rank in stopped)))
    return [f for *_, f in sorted(failures, key=lambda item: item[:3])]


def _state_words(state: str) -> str:
    """Why a process did not honour SIGTERM, from its state letter (/proc/PID/stat)."""
    if state in ("T", "t"):
        return "it was stopped (SIGSTOP, or a debugger)"
    if state == "D":
        return "it was in uninterruptible sleep (state D: waiting on a driver or a file system)"
    return "it was stuck outside Python, where its SIGTERM handler cannot run" + (
        f" (state {state})" if state not in ("", "?") else "")


def name_the_hang(failures: list[RankFailure], absent: list[Absent]) -> list[RankFailure]:
    """`failures` with the rank the others waited for first, when that is the root cause.

    The rule: a collective of this node timed out (its rank waited --timeout), no rank of this node failed
    of its own (a crash, a kill from outside or an error other than a collective's would have come
    first and caused the rest), and a rank the launcher had to end (SIGTERM, or SIGKILL when it did not
    answer) is named by the hang report as never entering a collective another rank failed in: that rank
    stopped responding, and its end by the launcher is a consequence. A rank killed from outside before
    any timeout is not one the launcher ended, and stays first as a kill."""
    timed_out = any("CollectiveError" in f.message and _TIMED_OUT.search(f.message) for f in failures)
    own = any(not f.stopped_by_launcher and "CollectiveError" not in f.message for f in failures)
    if not timed_out or own:
        return failures
    where: dict[int, Absent] = {}
    for a in absent:
        where.setdefault(a.rank, a)
    hung: list[RankFailure] = []
    for f in failures:
        a = where.get(f.rank)
        if a is None or not f.stopped_by_launcher or not f.how.startswith(_ENDED_BY_LAUNCHER):
            continue
        if a.last is not None:  # its record says where it was
            text = f"it never entered {a.where}, where rank {a.waiter} waited"
        else:
            text = f"it never took part in {a.where}, where rank {a.waiter} waited"
        end = ("the launcher then stopped it (SIGTERM)" if f.how.startswith("was stopped") else
               f"{f.message}, so the launcher killed it (SIGKILL)")
        hung.append(replace(f, how="stopped responding", message=f"{text}; {end}"))
    named = {f.rank for f in hung}
    return hung + [f for f in failures if f.rank not in named]
