"""torch's elastic agent (what torchrun runs), but once a worker has failed, the others get a short grace
after their SIGTERM before SIGKILL, not torch's 30 s.

Why not a setting: torch 2.13 closes the remaining workers of a failed group with PContext.close's
default timeout of 30 s (SubprocessContext._poll and LocalElasticAgent._stop_workers call it without
one; LaunchConfig.shutdown_timeout reaches neither), and its launch_agent builds its LocalElasticAgent
itself. So `run_workers` is launch_agent with `GraceAgent` in its place (without torch's metrics,
events and health-check server, which paratrain does not use), and GraceAgent stops the other workers
itself, before torch's own close finds them running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig


class WorkersFailed(ChildFailedError):
    """torch's ChildFailedError (the failed workers by global rank), and which of them the launcher
    stopped because another had failed first."""

    def __init__(self, failures: Mapping[int, ProcessFailure], stopped: Mapping[int, str]) -> None:
        super().__init__("paratrain", dict(failures))
        self.stopped = dict(stopped)
        """Global rank -> "" (it left after the launcher's SIGTERM) or its process state when the launcher
        SIGKILLed it after the grace ('T' stopped, 'D' uninterruptible sleep, 'S', 'R'; "?" unknown)."""


class GraceAgent(LocalElasticAgent):
    """LocalElasticAgent whose workers, once one has failed, are stopped with SIGTERM and SIGKILLed
    after grace_s: a worker that cannot run (stopped, stuck outside Python) never honours the SIGTERM,
    and torch's 30 s would only delay the job's end and its report."""

    def __init__(self, spec: WorkerSpec, logs_specs: LogsSpecs, *, start_method: str, grace_s: float) -> None:
        super().__init__(spec=spec, logs_specs=logs_specs, start_method=start_method)
        self.grace_s = grace_s
        self.stopped: dict[int, str] = {}
        """What WorkersFailed.stopped says, once the launcher has stopped workers."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        handlers: Mapping[int, SubprocessHandler] = getattr(self._pcontext, "subprocess_handlers", {})
        running = {worker_group.workers[local].global_rank: handler for local, handler in handlers.items()
                   if handler.proc.poll() is None}
        failed = any(handler.proc.poll() not in (None, 0) for handler in handlers.values())
        if failed and running and not self.stopped:
            self.stopped = _stop(running, self.grace_s)
        files = getattr(self._pcontext, "error_files", {})

        def drop_exited() -> None:  # the error files of workers that have exited (a running one may be writing)
            _drop_unreadable({local: files[local] for local, handler in handlers.items()
                              if local in files and handler.proc.poll() is not None})

        if failed:
            drop_exited()
        # torch's poll: the failures (its close finds none running)
        return _poll_past_cut_files(lambda: super(GraceAgent, self)._monitor_workers(worker_group), drop_exited)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.stopped = {}  # a new attempt: its failure stops its own workers (and WorkersFailed names those)
        super()._restart_workers(worker_group)


def _poll_past_cut_files(poll: Callable[[], RunResult], drop_exited: Callable[[], None]) -> RunResult:
    """poll(), again after drop_exited() when its parse of an error file raised: a worker exited (or torch's close
    stopped one) with a cut file after the agent's check. torch raises before it marks any worker done (it logs the
    parse error), so the next poll finds the same workers and reports them by exit code; tried three times."""
    for _ in range(2):
        try:
            return poll()
        except ValueError:
            drop_exited()
    return poll()


def _drop_unreadable(error_files: Mapping[int, str]) -> None:
    """Remove a worker's error file that is not JSON: one SIGKILLed (or stopped) while torch's @record wrote it
    leaves it empty or cut, and torch's ProcessFailure, which parses it, would raise instead of reporting the
    failure (the agent then dies, and a run with restarts left is not restarted). Without the file torch reports
    the worker by its exit code, as for any worker killed before it wrote one."""
    for path in error_files.values():
        try:
            with open(path) as file:
                json.load(file)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            try:
                os.remove(path)
            except OSError:
                pass


def _stop(handlers: Mapping[int, SubprocessHandler], grace_s: float) -> dict[int, str]:
    """SIGTERM each worker (its process group, as torch does), then SIGKILL those still running after
    grace_s; what WorkersFailed.stopped says of them."""
    for handler in handlers.values():
        _signal(handler, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    stopped: dict[int, str] = {}
    for rank, handler in handlers.items():
        try:
            handler.proc.wait(max(0.0, deadline - time.monotonic()))
            stopped[rank] = ""
        except subprocess.TimeoutExpired:
            stopped[rank] = _process_state(handler.proc.pid)
            _signal(handler, signal.SIGKILL)
    deadline = time.monotonic() + grace_s  # bounded, as torch's: one in uninterruptible sleep outlives SIGKILL a while
    for rank, state in stopped.items():
        if state:
            try:
                handlers[rank].proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return stopped


def _signal(handler: SubprocessHandler, sig: signal.Signals) -> None:
    try:
        handler.close(death_sig=sig)
    except ProcessLookupError:  # it left meanwhile
        pass


def _process_state(pid: int) -> str:
    """The state letter in /proc/PID/stat (after the command name, which may hold spaces and
    parentheses), or "?" where there is none to read (not Linux, or it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "?"


def run_workers(config: LaunchConfig, args: list[str], *, grace_s: float) -> None:
    """Run `python *args` on config.nproc_per_node local processes under GraceAgent, as torch's
    launch_agent (behind elastic_launch and torchrun) would. Raises WorkersFailed when a worker fails,
    and torch's rendezvous errors when the nodes do not meet."""
    rendezvous = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                      local_addr=config.local_addr, **config.rdzv_configs)
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":  # its store is node 0's, at the endpoint (as launch_agent sets it)
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=sys.executable,
                      args=tuple(args), rdzv_handler=get_rendezvous_handler(rendezvous),
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      master_addr=master_addr, master_port=master_port, local_addr=config.local_addr)
    assert config.logs_specs is not None  # LaunchConfig sets its default
    agent = GraceAgent(spec, config.logs_specs, start_method=config.start_method, grace_s=grace_s)
    close_rendezvous = True
    try:
        result = agent.run()
        if result.is_failed():
            raise WorkersFailed(result.failures, agent.stopped)
    except SignalException:  # as launch_agent: a launcher killed by a signal leaves the rendezvous open
        close_rendezvous = False
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
