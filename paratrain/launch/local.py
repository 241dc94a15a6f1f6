"""Start the processes of a job through torch's elastic launcher (the machinery behind torchrun).

Each worker runs `python -m paratrain <the same arguments>`; seeing the launcher's RANK/WORLD_SIZE,
it trains instead of launching. A job started by an external torchrun takes the same path.
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass

from paratrain.config.run import LaunchSection


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun or by `paratrain train` (the launcher's env is set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exitcode: int
    message: str


class JobFailed(RuntimeError):
    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        first = failures[0] if failures else None
        text = f"rank {first.rank} failed (exit code {first.exitcode}): {first.message}" if first else "job failed"
        if len(failures) > 1:
            text += f" (and {len(failures) - 1} more rank(s))"
        super().__init__(text)


def launch(launch_cfg: LaunchSection, argv: list[str]) -> None:
    """Run `python -m paratrain *argv` on nproc local processes (this node's share of the job)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from paratrain.launch.worker import threads_per_rank

    single_node = launch_cfg.nnodes == 1
    if single_node:  # torchrun --standalone: a private rendezvous on a free local port
        backend, endpoint, run_id, rdzv_configs = "c10d", "localhost:0", str(uuid.uuid4()), {}
    else:
        backend, endpoint, run_id = launch_cfg.rdzv_backend, launch_cfg.rdzv_endpoint, launch_cfg.rdzv_id
        rdzv_configs = {"rank": launch_cfg.node_rank} if backend == "static" else {}
    rdzv_configs["timeout"] = int(launch_cfg.timeout_s)
    config = LaunchConfig(
        min_nodes=launch_cfg.nnodes, max_nodes=launch_cfg.nnodes, nproc_per_node=launch_cfg.nproc,
        run_id=run_id, rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
        max_restarts=0, monitor_interval=0.1, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(launch_cfg.nproc)))
    try:
        elastic_launch(config, sys.executable)("-m", "paratrain", *argv)
    except ChildFailedError as error:
        raise JobFailed(_failures(error)) from None


def _failures(error: object) -> list[RankFailure]:
    """The failed ranks, root cause first: a rank that raised (exit code > 0) before one the agent
    killed afterwards (negative: a signal), then the earliest error, then the lowest rank."""
    failures = []
    items = getattr(error, "failures", {}).items()
    for rank, failure in sorted(items, key=lambda kv: (kv[1].exitcode < 0, kv[1].timestamp, kv[0])):
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        text = str(message or "").strip()
        if not text or text.startswith("To enable traceback"):
            text = f"exited with code {failure.exitcode} (see its traceback above)"
        failures.append(RankFailure(rank=rank, exitcode=failure.exitcode, message=text))
    return failures
