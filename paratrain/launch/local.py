"""Start the processes of a job through torch's elastic launcher (the machinery behind torchrun; its
agent as paratrain.launch.agent runs it, which stops a failed job's other workers within SHUTDOWN_GRACE_S).

Each worker runs `python -m paratrain worker --run-plan FILE`: the run the launching process resolved
(paratrain.config.write_run), which it builds its RunPlan from against the world it meets. A job started
by an external torchrun runs `paratrain train` on every process instead, which trains from its flags.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from paratrain.config.run import LaunchSection
from paratrain.launch.failures import SHUTDOWN_GRACE_S, JobFailed, failures_of, name_the_hang, short, with_roles
from paratrain.topology.recorder import absent_ranks


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun or by `paratrain train` (the launcher's env is set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


LAST_CALL_S = 5
"""With --min-nodes, how long a relaunch's rendezvous waits for more nodes once it has the fewest."""


LIVE_REFRESH_S = 5.0
LIVE_STALE_S = 30.0
"""A running job's launchers touch SAVE/flight/live.json every LIVE_REFRESH_S; a node started again
rejoins the attempt it names only if it was touched within LIVE_STALE_S."""

RECORDS_WAIT_S = 5.0
"""Across nodes: how long a failed node's launcher waits for the other nodes' ranks to leave their
flight records in the shared folder before it writes its hang report."""


def launch(launch_cfg: LaunchSection, run_file: Path, *, shared: str | None = None, memory_copies: int = 0) -> None:
    """Run `python -m paratrain worker --run-plan RUN_FILE` on nproc local processes (this node's share of
    the job): each builds its RunPlan from the run file, which this node's launcher wrote.

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
    node): a local temporary folder, and no rejoining.

    memory_copies K > 0: this launcher keeps a Keeper for the job's whole life (every attempt): the RAM its own
    workers' and the previous K nodes' workers' checkpoint copies go to (paratrain.checkpoint.memory_copies)."""
    live = Path(shared) / "flight" / "live.json" if shared and launch_cfg.nnodes > 1 else None
    first = _live_attempt(live, launch_cfg) if live is not None else 0
    alive = threading.Event()
    if live is not None:  # refreshed while this launcher runs: a file nobody refreshes is a dead job's
        threading.Thread(target=_refresh, args=(live, alive), daemon=True).start()
    argv = ["worker", "--run-plan", str(run_file)]
    keeper = _start_keeper(launch_cfg) if memory_copies else None
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
        if keeper is not None:
            keeper.close()


def _start_keeper(launch_cfg: LaunchSection) -> Any:
    """This node's Keeper, on the address the rendezvous is reached by; its workers told where (inherited env)."""
    from paratrain.checkpoint.memory_copies import Keeper, job_key, reachable_host

    key = job_key(launch_cfg.rdzv_endpoint, launch_cfg.rdzv_id)
    keeper = Keeper(reachable_host(launch_cfg.rdzv_endpoint), key)
    os.environ.update(keeper.environment(key))
    return keeper


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

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(launch_cfg.nproc + launch_cfg.servers)))
    return LaunchConfig(  # this node's trainers, and the last node the dedicated parameter servers after them
        min_nodes=min_nodes, max_nodes=launch_cfg.nnodes, nproc_per_node=launch_cfg.nproc + launch_cfg.servers,
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
        raise JobFailed(failures_of(error, error.stopped)) from None


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
            # (the servers' records too, when they come: they are the last node's)
        absent = absent_ranks(flight)
        report = [a.line(partial=not single_node and not shared) for a in absent]
        failures = with_roles(name_the_hang(failures_of(error, error.stopped), absent), launch_cfg.first_server)
        raise JobFailed(failures, report, other_nodes=not single_node) from None
    except RendezvousConnectionError as error:  # the agent that hosted the store is gone (its node was lost)
        raise JobFailed([], reason=(
            f"this node lost the rendezvous store at {endpoint} ({short(str(error))}): the node that hosted it "
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
