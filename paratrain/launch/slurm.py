"""Under SLURM: `srun --ntasks-per-node=1 paratrain train ...` runs one launcher per node, and the
node count, this node's rank and the rendezvous (the first node of the allocation) come from SLURM's
variables, so the same command line runs on every node. Flags given explicitly still win."""

from __future__ import annotations

import re
from collections.abc import Mapping

from paratrain.config.errors import ConfigError


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded: "gpu[01-03,07],login1" -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", text):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def slurm_overrides(env: Mapping[str, str]) -> dict[str, object]:
    """Launch settings from SLURM's variables ({} outside a job step that srun started: an salloc
    shell or a batch script's own step runs paratrain as on any machine)."""
    if not {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NNODES"} <= set(env):
        return {}
    nnodes = int(env["SLURM_NNODES"])
    tasks = int(env.get("SLURM_NTASKS", nnodes))
    if tasks != nnodes:
        raise ConfigError(f"under SLURM paratrain runs one task per node, which starts that node's processes: "
                          f"SLURM_NTASKS = {tasks} over SLURM_NNODES = {nnodes}; use srun --ntasks-per-node=1 "
                          "(and --nproc for the processes per node)")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ConfigError("SLURM_JOB_NODELIST is empty: the rendezvous runs on the allocation's first node")
    port = int(env.get("MASTER_PORT", "29500"))
    return {"launch.nnodes": nnodes, "launch.node_rank": int(env.get("SLURM_NODEID", env.get("SLURM_PROCID", "0"))),
            "launch.rdzv_endpoint": f"{hosts[0]}:{port}", "launch.rdzv_id": f"slurm-{env['SLURM_JOB_ID']}"}
