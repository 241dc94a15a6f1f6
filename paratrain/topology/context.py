"""paratrain.init: join (or start) the process group of a job and lay the ranks out on a Mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.config.parallel import ParallelConfig
from paratrain.topology.dims import ParallelDims
from paratrain.topology.mesh import Mesh


@dataclass(frozen=True)
class Context:
    """What one process knows about the job it is part of. Pass it explicitly."""

    config: ParallelConfig
    """The parallel config, resolved against the world size (dp filled in)."""
    mesh: Mesh
    rank: int
    world_size: int
    device: torch.device
    backend: str
    """'gloo', 'nccl', or 'none' for a single process without torch.distributed."""

    @property
    def dims(self) -> ParallelDims:
        return self.mesh.dims

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and writes files."""
        return self.rank == 0


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(config: ParallelConfig | None = None, *, timeout: timedelta = timedelta(minutes=5),
         backend: str | None = None) -> Context:
    """Build this process's Context.

    Inside a launched job (RANK / WORLD_SIZE set by torchrun or `paratrain train`) this joins the
    job's default process group, creating it if needed; alone, it returns a single-process
    context that never communicates. The backend is NCCL when CUDA is available, gloo otherwise.
    """
    config = config or ParallelConfig()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not dist.is_initialized() and launched:
        chosen = backend or default_backend()
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen, timeout=timeout)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        used_backend = str(dist.get_backend())
    else:
        rank, world_size, used_backend = 0, 1, "none"
    resolved = config.resolved(world_size)
    dims = ParallelDims.from_config(config, world_size)
    shard_group = (resolved.shard_group or resolved.dp) if resolved.zero else None
    mesh = Mesh.build(dims, rank, timeout=timeout, shard_group=shard_group) if world_size > 1 else Mesh.single()
    if used_backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    elif used_backend == "none" and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    return Context(
        config=resolved, mesh=mesh, rank=rank, world_size=world_size,
        device=device, backend=used_backend,
    )
