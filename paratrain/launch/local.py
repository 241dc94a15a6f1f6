"""Start the processes of a job through torch's elastic launcher (the machinery behind torchrun; its
agent as paratrain.launch.agent runs it, which stops a failed job's other workers within SHUTDOWN_GRACE_S).

Each worker runs `python -m paratrain <the same arguments>`; seeing the launcher's RANK/WORLD_SIZE,
it trains instead of launching. A job started by an external torchrun takes the same path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from paratrain.config.run import LaunchSection
from paratrain.topology.recorder import Absent, absent_ranks


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun or by `paratrain train` (the launcher's env is set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


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
        text = f"rank {first.rank} {first.how}: {first.message}"
        if other_nodes and all("CollectiveError" in f.message or f.how.startswith(_ENDED_BY_LAUNCHER)
                               for f in failures):
            text = ("no rank of this node failed first: its collectives lost a peer, so the cause is on another "
                    "node (its launcher's output says what; a node killed whole says nothing)\n" + text)
        if rest:
            then = "; ".join(f"rank {f.rank} {f.how}: {_short(f.message)}" for f in rest[:3])
            more = f"; and {len(rest) - 3} more" if len(rest) > 3 else ""
            text += f"\nthen: {then}{more}"
        if self.hangs:
            text += "\nhang report: " + "\n".join(self.hangs)
        super().__init__(text)


def _short(message: str, limit: int = 160) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= limit else line[: limit - 3] + "..."


SHUTDOWN_GRACE_S = 3
"""Once a rank has failed, how long the launcher gives the others to leave after its SIGTERM before it
SIGKILLs them. A rank that can run writes its flight record and leaves in well under a second; one that
cannot (stopped, stuck outside Python) never will, and torch's own 30 s only delayed the end of the job
and its report (a rank SIGSTOPped with --timeout 5: the job ended 37 s after the stop, now 10 s)."""

LAST_CALL_S = 5
"""With --min-nodes, how long a relaunch's rendezvous waits for more nodes once it has the fewest."""


LIVE_REFRESH_S = 5.0
LIVE_STALE_S = 30.0
"""A running job's launchers touch SAVE/flight/live.json every LIVE_REFRESH_S; a node started again
rejoins the attempt it names only if it was touched within LIVE_STALE_S."""

RECORDS_WAIT_S = 5.0
"""Across nodes: how long a failed node's launcher waits for the other nodes' ranks to leave their
flight records in the shared folder before it writes its hang report."""


def launch(launch_cfg: LaunchSection, argv: list[str], *, shared: str | None = None) -> None:
    """Run `python -m paratrain *argv` on nproc local processes (this node's share of the job).

    With max_restarts N, a failed job is launched again, up to N times, each time as a new job with a
    new rendezvous (torch's own in-place restart of the workers failed here: the restarted gloo
    workers' process group could not connect, "Connection refused", torch 2.13) and `--attempt K`:
    the workers resume from the newest checkpoint under --save that verifies. The failure of each
    attempt is reported as it happens. Across nodes every node's launcher does the same: attempt K
    meets on the endpoint's port + K (run id suffixed -K), so that no node joins the store of an
    earlier attempt that node 0 has not yet closed. With min_nodes (c10d), a relaunch waits for every
    node until the rendezvous has min_nodes, then LAST_CALL_S more, and goes on with those that came:
    the workers see the smaller world, dp follows it, and they resume from the checkpoint as ever.

    shared: a folder every node sees (the run's --save), where across nodes each rank leaves its flight
    record (SHARED/flight/attempt-K/rankN.json), so that every node's hang report covers the ranks of
    every node, and the launchers keep the job's live attempt (SHARED/flight/live.json): a node lost
    whole and started again with the same command reads it and rejoins that attempt's rendezvous,
    where the other nodes wait for it (up to --timeout); the file goes when the job ends. None (or one
    node): a local temporary folder, and no rejoining."""
    live = Path(shared) / "flight" / "live.json" if shared and launch_cfg.nnodes > 1 else None
    first = _live_attempt(live, launch_cfg) if live is not None else 0
    alive = threading.Event()
    if live is not None:  # refreshed while this launcher runs: a file nobody refreshes is a dead job's
        threading.Thread(target=_refresh, args=(live, alive), daemon=True).start()
    try:
        for attempt in range(first, launch_cfg.max_restarts + 1):
            if live is not None:  # replaced whole: a node reading it never sees half of it
                live.parent.mkdir(parents=True, exist_ok=True)
                draft = live.with_name(f"live.{os.getpid()}.tmp")
                draft.write_text(json.dumps({"rdzv_endpoint": launch_cfg.rdzv_endpoint,
                                             "rdzv_id": launch_cfg.rdzv_id, "attempt": attempt}))
                os.replace(draft, live)
            try:
                _launch_once(launch_cfg, [*argv, "--attempt", str(attempt)] if attempt else argv, attempt=attempt,
                             shared=shared)
                return
            except JobFailed as failure:
                if attempt == launch_cfg.max_restarts:
                    raise
                print(f"paratrain: attempt {attempt} failed: {failure}\nparatrain: restarting "
                      f"({attempt + 1} of {launch_cfg.max_restarts}) from the newest verified checkpoint",
                      file=sys.stderr, flush=True)
    finally:
        alive.set()
        if live is not None:
            live.unlink(missing_ok=True)


def _refresh(live: Path, done: threading.Event) -> None:
    while not done.wait(LIVE_REFRESH_S):
        try:
            os.utime(live)
        except OSError:
            pass


def _live_attempt(live: Path, launch_cfg: LaunchSection) -> int:
    """The attempt a job with this endpoint and id is running (its live.json), or 0: where a node
    started again after it was lost rejoins."""
    try:
        record = json.loads(live.read_text())
        age = time.time() - live.stat().st_mtime
    except (OSError, ValueError):
        return 0
    if age > LIVE_STALE_S:  # a job killed whole on every node: no launcher refreshes it
        print(f"paratrain: {live} was last refreshed {age:.0f} s ago: its job is gone; starting afresh",
              file=sys.stderr, flush=True)
        return 0
    if (record.get("rdzv_endpoint"), record.get("rdzv_id")) != (launch_cfg.rdzv_endpoint, launch_cfg.rdzv_id):
        return 0
    attempt = int(record.get("attempt", 0))
    if attempt > launch_cfg.max_restarts:
        raise JobFailed([], reason=(
            f"{live} says the job runs attempt {attempt}, beyond --max-restarts {launch_cfg.max_restarts}: give "
            f"--max-restarts {attempt} or more to rejoin it, or delete {live} if no job runs"))
    if attempt and launch_cfg.min_nodes and launch_cfg.min_nodes < launch_cfg.nnodes:
        raise JobFailed([], reason=(
            f"the job at {launch_cfg.rdzv_endpoint} runs attempt {attempt} and may have gone on without this node "
            f"(--min-nodes {launch_cfg.min_nodes}); joining a running job is not supported: this node joins at the "
            f"job's next relaunch, or start the job again once it ends (delete {live} if no job runs)"))
    if attempt:
        print(f"paratrain: rejoining attempt {attempt} of the job at {launch_cfg.rdzv_endpoint} ({live}; delete it "
              "if that job is no longer running)", file=sys.stderr, flush=True)
    return attempt


def _elastic_config(launch_cfg: LaunchSection, attempt: int) -> tuple[Any, str]:
    """torch's elastic LaunchConfig for this node's share of attempt `attempt`, and its endpoint."""
    from torch.distributed.launcher.api import LaunchConfig

    single_node = launch_cfg.nnodes == 1
    if single_node:  # torchrun --standalone: a private rendezvous on a free local port
        backend, endpoint, run_id, rdzv_configs = "c10d", "localhost:0", str(uuid.uuid4()), {}
    else:
        backend, endpoint, run_id = launch_cfg.rdzv_backend, launch_cfg.rdzv_endpoint, launch_cfg.rdzv_id
        if attempt:  # a fresh rendezvous per attempt: the last one's store may still be up on node 0
            host, _, port = endpoint.rpartition(":")
            endpoint, run_id = f"{host}:{int(port) + attempt}", f"{run_id}-{attempt}"
        rdzv_configs = {"rank": launch_cfg.node_rank} if backend == "static" else {}
    rdzv_configs["timeout"] = int(launch_cfg.timeout_s)
    min_nodes = launch_cfg.nnodes  # the first launch waits for every node
    if attempt and launch_cfg.min_nodes and launch_cfg.min_nodes < launch_cfg.nnodes:
        min_nodes = launch_cfg.min_nodes
        rdzv_configs["last_call_timeout"] = LAST_CALL_S
    from paratrain.launch.worker import threads_per_rank

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(launch_cfg.nproc)))
    return LaunchConfig(
        min_nodes=min_nodes, max_nodes=launch_cfg.nnodes, nproc_per_node=launch_cfg.nproc,
        run_id=run_id, rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    ), endpoint


def launch_script(launch_cfg: LaunchSection, script: list[str], *, attempt: int = 0) -> None:
    """Run `python *script` (a script and its arguments) on nproc local processes, once: how
    paratrain.Trainer starts its own workers when run as a plain script. attempt K > 0: a relaunch,
    meeting on a fresh rendezvous (as `paratrain train`'s). Raises JobFailed."""
    from paratrain.launch.agent import WorkersFailed, run_workers

    config, _ = _elastic_config(launch_cfg, attempt)
    try:
        run_workers(config, script, grace_s=SHUTDOWN_GRACE_S)
    except WorkersFailed as error:
        raise JobFailed(_failures(error, error.stopped)) from None


def _launch_once(launch_cfg: LaunchSection, argv: list[str], *, attempt: int = 0, shared: str | None = None) -> None:
    import torch.distributed
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from paratrain.launch.agent import WorkersFailed, run_workers

    single_node = launch_cfg.nnodes == 1
    config, endpoint = _elastic_config(launch_cfg, attempt)
    if shared and not single_node:  # every node's records in one folder: each report covers every rank
        flight = str(Path(shared) / "flight" / f"attempt-{attempt}")
        Path(flight).mkdir(parents=True, exist_ok=True)
        for stale in Path(flight).glob("rank*.json"):  # an earlier run's: no worker of this one has started
            stale.unlink(missing_ok=True)
    else:
        flight = tempfile.mkdtemp(prefix="paratrain-flight-")  # this node's workers' records, read on failure
    try:
        run_workers(config, ["-m", "paratrain", *argv, "--flight-dir", flight], grace_s=SHUTDOWN_GRACE_S)
    except WorkersFailed as error:
        if not single_node:
            _wait_for_records(flight, launch_cfg.nproc * launch_cfg.nnodes)  # fewer (--min-nodes): 5 s at most
        absent = absent_ranks(flight)
        report = [a.line(partial=not single_node and not shared) for a in absent]
        raise JobFailed(_name_the_hang(_failures(error, error.stopped), absent), report,
                        other_nodes=not single_node) from None
    except RendezvousConnectionError as error:  # the agent that hosted the store is gone (its node was lost)
        raise JobFailed([], reason=(
            f"this node lost the rendezvous store at {endpoint} ({_short(str(error))}): the node that hosted it "
            "was lost or cut off")) from None
    except torch.distributed.DistError as error:  # the nodes never met: no worker started
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise JobFailed([], reason=(
            f"the rendezvous of {launch_cfg.nnodes} nodes at {endpoint} failed: {first}. Every node must be "
            f"started with the same --nnodes and --rdzv-endpoint and its own --node-rank, within --timeout "
            f"({launch_cfg.timeout_s:g} s) of each other")) from None
    finally:
        if not (shared and not single_node):
            shutil.rmtree(flight, ignore_errors=True)


def _wait_for_records(folder: str, ranks: int) -> None:
    """Until `ranks` flight records are in `folder` (the other nodes' ranks fail or are stopped about
    when this node's do) or RECORDS_WAIT_S has passed."""
    deadline = time.monotonic() + RECORDS_WAIT_S
    while len(list(Path(folder).glob("rank*.json"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.1)


_ENDED_BY_LAUNCHER = ("was stopped by the launcher", "was killed by the launcher")
"""The start of RankFailure.how for a rank with no error of its own that the launcher ended."""

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
"""A collective's error that says it waited its whole timeout (gloo: "Timed out waiting 5000ms for
recv"; NCCL: "Watchdog caught collective operation timeout")."""


def _failures(error: object, stopped: Mapping[int, str] | None = None) -> list[RankFailure]:
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


def _name_the_hang(failures: list[RankFailure], absent: list[Absent]) -> list[RankFailure]:
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
