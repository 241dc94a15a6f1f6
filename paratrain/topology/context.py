"""paratrain.init: join (or start) the process group of a job and lay the ranks out on a Mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig
from paratrain.config.world import DEVICES, resolve_device
from paratrain.topology.dims import ParallelDims
from paratrain.topology.quorum import Quorum
from paratrain.topology.mesh import Mesh


@dataclass(frozen=True)
class Context:
    """What one process knows about the job it is part of. Pass it explicitly."""

    config: ParallelConfig
    """The parallel config, resolved against the world size (dp filled in)."""
    dims: ParallelDims
    """The degree of every axis, built once from `config`."""
    mesh: Mesh
    rank: int
    world_size: int
    device: torch.device
    backend: str
    """'gloo', 'nccl', or 'none' for a single process without torch.distributed."""
    replicas: Quorum | None = None
    """Under fault tolerance (fault_tolerance 'replica'): this replica group's place among the others, whose
    worlds are apart (rank and world_size are this group's); None otherwise."""

    @property
    def is_main(self) -> bool:
        """Rank 0 (of replica group 0 under fault tolerance): the one that prints, logs and writes files."""
        return self.rank == 0 and (self.replicas is None or self.replicas.group == 0)

    @property
    def is_server(self) -> bool:
        """A dedicated parameter server (paratrain.param_server): it runs the servers' loop, not training."""
        return self.dims.is_server(self.rank)

    def close(self) -> None:
        """Release the mesh's process groups (Mesh.close); the job's default group stays. `with paratrain.init(...)
        as ctx:` closes at the end of the block. Close the engines built on it first (Engine.close)."""
        self.mesh.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Member:
    """This process's place in a job it has joined, before any layout: the world the config is
    resolved against."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    """'gloo', 'nccl', or 'none' for a single process without torch.distributed."""


def init(config: ParallelConfig | None = None, *, device: str = "auto",
         timeout: timedelta = timedelta(minutes=5)) -> Context:
    """Build this process's Context, on `device`: 'cpu', 'cuda', or 'auto': join the job (`join`),
    resolve `config` against its world size, and lay the ranks out (`lay_out`).

    Inside a launched job (RANK / WORLD_SIZE set by torchrun or `paratrain train`) this joins the
    job's default process group, creating it if needed: NCCL for CUDA (one GPU per process,
    cuda:LOCAL_RANK), gloo for the CPU. Alone, it returns a single-process context that never
    communicates. 'auto' follows a process group that already exists (NCCL: CUDA, gloo: CPU), and
    otherwise takes CUDA when a GPU is visible. Name the device wherever results are compared across
    processes: a CUDA reference and CPU ranks differ by two machines' rounding.
    """
    member = join(device, timeout=timeout)
    return lay_out(member, (config or ParallelConfig()).resolved(member.world_size), timeout=timeout)


def join(device: str = "auto", *, timeout: timedelta = timedelta(minutes=5)) -> Member:
    """Join the job's default process group (see `init`), or stand alone as a single process."""
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if dist.is_initialized():
        backend = str(dist.get_backend())
        kind = ("cuda" if backend == "nccl" else "cpu") if device == "auto" else device
        if (backend == "nccl") != (kind == "cuda"):
            raise RuntimeError(f"the job's process group uses {backend}, which does not serve device {kind!r}: NCCL "
                               f"is for CUDA tensors, gloo for CPU tensors; ask for device "
                               f"{'cuda' if backend == 'nccl' else 'cpu'}")
    else:
        kind = resolve_device(device, gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched: join the job
            if kind == "cuda":
                torch.cuda.set_device(_local_gpu())
            dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=timeout)
    if dist.is_initialized():
        rank, world_size, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    else:
        rank, world_size, backend = 0, 1, "none"
    if kind == "cuda":
        on = torch.device("cuda", torch.cuda.current_device() if backend == "nccl" else 0)
    else:
        on = torch.device("cpu")
    return Member(rank=rank, world_size=world_size, device=on, backend=backend)


def lay_out(member: Member, resolved: ParallelConfig, *, timeout: timedelta = timedelta(minutes=5),
            replicas: Quorum | None = None) -> Context:
    """The Context of a joined process under a config already resolved against its world size
    (ParallelConfig.resolved, or a RunPlan's): the dims are built once here and the mesh reads them.
    Collective when the world has more than one process (every rank builds the same groups)."""
    dims = ParallelDims.from_config(resolved)
    if dims.world_size != member.world_size:
        servers = f" + {dims.servers} parameter servers" if dims.servers else ""
        raise ConfigError(f"the layout was resolved for {dims.world_size} processes (dp x tp x pp = {dims.dp} x "
                          f"{dims.tp} x {dims.pp}{servers}), and the job has {member.world_size}: resolve it against "
                          f"{member.world_size} (ParallelConfig.resolved)")
    mesh = Mesh.build(dims, member.rank, timeout=timeout) if member.world_size > 1 else Mesh.single()
    return Context(config=resolved, dims=dims, mesh=mesh, rank=member.rank, world_size=member.world_size,
                   device=member.device, backend=member.backend, replicas=replicas)


def _local_gpu() -> int:
    """This process's GPU under NCCL: cuda:LOCAL_RANK, which must exist."""
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} needs GPU {local_rank}, but this node has {count} visible GPU(s) for "
            f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} processes: under NCCL each process takes one GPU. Start at "
            f"most {count} processes per node, or use device 'cpu' (gloo)")
    return local_rank
