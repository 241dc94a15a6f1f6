"""The launch's world: the device a node trains on, and the processes the launcher starts (before any
layout is resolved against them)."""

from __future__ import annotations

from paratrain.config.errors import ConfigError
from paratrain.config.run import RunConfig


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, *, gpus: int) -> str:
    """'cpu' or 'cuda' for a requested device, given the GPUs this node sees: 'auto' is CUDA when
    there is one, else the CPU."""
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise ConfigError("device cuda was asked for, but torch sees no CUDA GPU on this node (a CPU build of torch, "
                          "or CUDA_VISIBLE_DEVICES empty): use device cpu")
    return device


def launch_world_size(config: RunConfig, *, gpus: int) -> int:
    """Processes the launcher will start: nproc x nnodes. Without --nproc, nproc follows --dp (the layout's world,
    dp x tp x pp x cp and the dedicated parameter servers, over nnodes: ParallelConfig.world_size), else one per
    visible GPU on CUDA, 2 on the CPU. `gpus`: the CUDA devices this node sees; under NCCL each process takes one,
    so a node may not start more."""
    launch, parallel = config.launch, config.parallel
    if launch.nproc < 0:
        raise ConfigError(f"nproc ({launch.nproc}) must be >= 1 processes per node (or 0: one per GPU on CUDA, "
                          "the layout's world / nnodes when --dp is given, else 2)")
    if launch.nnodes < 1:
        raise ConfigError(f"nnodes ({launch.nnodes}) must be >= 1")
    for axis in ("dp", "tp", "pp"):
        degree = getattr(parallel, axis)
        if degree is not None and degree < 1:
            raise ConfigError(f"{axis} ({degree}) must be >= 1")
    device = resolve_device(launch.device, gpus=gpus)
    if launch.nproc:
        per_node = launch.nproc
    elif parallel.dp is None:
        per_node = gpus if device == "cuda" else 2
    else:
        world = parallel.world_size  # the trainers (dp x tp x pp x cp) and the dedicated servers
        if world % launch.nnodes:
            raise ConfigError(
                f"the layout's {world} processes (dp x tp x pp x cp = {parallel.trainers}, and "
                f"{parallel.ps_servers} parameter servers) do not split evenly over {launch.nnodes} nodes: "
                f"give --nproc (processes per node) or another dp"
            )
        per_node = world // launch.nnodes
    if device == "cuda" and per_node > gpus:
        raise ConfigError(
            f"{per_node} processes per node on CUDA need {per_node} GPUs (NCCL gives each process one), but this node "
            f"sees {gpus}: start at most {gpus} per node (--nproc {gpus}, and a layout whose world is "
            f"{gpus} x nnodes), or train on the CPU with --device cpu (gloo)"
        )
    return per_node * launch.nnodes


def check_min_nodes(config: RunConfig) -> None:
    """--min-nodes: a relaunch may meet with fewer nodes, so dp must follow the world and every world
    from min_nodes to nnodes nodes must be a valid layout (checked by the caller, prepare_launch)."""
    launch = config.launch
    if not 1 <= launch.min_nodes <= launch.nnodes:
        raise ConfigError(f"min_nodes ({launch.min_nodes}) must be in 1..nnodes ({launch.nnodes}): the fewest nodes a "
                          "relaunch may go on with")
    if launch.min_nodes < launch.nnodes:
        if launch.rdzv_backend != "c10d":
            raise ConfigError(f"--min-nodes {launch.min_nodes} < --nnodes {launch.nnodes} needs --rdzv-backend c10d: "
                              "the static rendezvous has fixed node ranks and waits for every node")
        if not launch.max_restarts:
            raise ConfigError(f"--min-nodes {launch.min_nodes} takes effect when the job is relaunched: give "
                              "--max-restarts N (and --save DIR)")
        if config.parallel.dp is not None:
            raise ConfigError(f"--min-nodes {launch.min_nodes} recomputes dp from the nodes that meet: drop --dp "
                              f"{config.parallel.dp} (dp = processes / (tp x pp))")
