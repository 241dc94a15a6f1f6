"""The first launcher of a fault-tolerant job (`--fault-tolerance replica`): it holds the lighthouse (a TCPStore the
replica groups meet at: paratrain.topology.quorum) and starts each replica group as a launcher of its own
(`python -m paratrain replica-group --run-plan FILE`), so a group that dies takes only its own workers down. The job
succeeds when a group finishes the run; a lost group is said, with the command that starts it again (it then joins
the running job at a step boundary).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from paratrain.config import RunConfig, RunPlan, write_run
from paratrain.config.run import LaunchSection


def launch_replica_groups(config: RunConfig, plan: RunPlan) -> int:
    """This node's replica groups (node_groups), each a job of its own inside the node, meeting at the lighthouse
    (hold_lighthouse). 0 when a group of this node finished the run (or, across nodes, none of its groups was
    lost), else 1."""
    groups, nodes = plan.parallel.replica_groups, config.launch.nnodes
    mine = node_groups(groups, nodes, config.launch.node_rank)
    per_group = config.launch.nproc // len(mine)
    store, address = hold_lighthouse(config.launch)
    where = f"replica groups {list(mine)} of {groups}" if nodes > 1 else f"{groups} replica groups"
    print(f"paratrain: {where} of {per_group} processes meet at the lighthouse {address}; a lost group starts again "
          f"with the same command and --nproc {per_group} --replica-group G --lighthouse {address}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-replicas-") as folder:
        children = []
        for g in mine:  # each inside this node: its own one-node launch
            launch = dataclasses.replace(config.launch, nproc=per_group, replica_group=g, lighthouse=address,
                                         nnodes=1, node_rank=0, rdzv_endpoint="", min_nodes=0)
            run_file = write_run(dataclasses.replace(config, launch=launch,
                                                     parallel=dataclasses.replace(config.parallel, dp=plan.parallel.dp)),
                                 Path(folder) / f"group-{g}.json")
            children.append(subprocess.Popen([sys.executable, "-m", "paratrain", "replica-group", "--run-plan",
                                              str(run_file)]))
        codes = [child.wait() for child in children]
    lost = [g for g, code in zip(mine, codes) if code]
    say_lost(lost, mine, nodes=nodes, address=address, again="--replica-group G --lighthouse")
    del store  # the lighthouse goes with the job
    return 0 if len(lost) < len(mine) else 1


def node_groups(groups: int, nodes: int, node: int) -> range:
    """The replica groups node `node` of `nodes` runs: all of them on one node, groups n R / N .. (n + 1) R / N - 1
    across nodes (each group a job inside one node)."""
    return range(node * groups // nodes, (node + 1) * groups // nodes)


def hold_lighthouse(launch: LaunchSection) -> tuple[dist.TCPStore | None, str]:
    """The store the replica groups meet at, and its HOST:PORT: on one node a store on a free local port, across
    nodes node 0's at the rendezvous endpoint, which the other nodes' launchers connect to (None there). Keep the
    store referenced for the job's life."""
    timeout = timedelta(seconds=max(60.0, launch.timeout_s))
    if launch.nnodes == 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return store, f"127.0.0.1:{store.port}"
    if launch.node_rank != 0:
        return None, launch.rdzv_endpoint
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=timeout), \
        launch.rdzv_endpoint


def say_lost(lost: list[int], mine: range, *, nodes: int, address: str, again: str) -> None:
    """The launcher's line on this node's lost groups (none lost: nothing), with how one starts again."""
    if lost and len(lost) < len(mine):
        print(f"paratrain: replica group(s) {lost} were lost; the others finished the run", file=sys.stderr, flush=True)
    elif lost and nodes > 1:
        print(f"paratrain: this node's replica group(s) {lost} were lost; the other nodes' groups go on (start one "
              f"again with {again} {address})", file=sys.stderr, flush=True)


def one_group_launch(launch: LaunchSection) -> LaunchSection:
    """A replica group started by hand (--replica-group G, with the job's own flags): a job inside this node."""
    return dataclasses.replace(launch, nnodes=1, node_rank=0, rdzv_endpoint="", min_nodes=0)
