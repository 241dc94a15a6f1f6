"""A launching Trainer's replica groups (`Trainer(fault_tolerance="replica", replica_groups=R)`): each group its own
launch of the script and its own world, meeting the others at the lighthouse (paratrain.topology.quorum), so a group
that dies takes only its own workers down and the others redo the step it failed in.

    the launching process   holds the lighthouse (paratrain.launch.replicas.hold_lighthouse) and runs the script
                            once per replica group of its node, each told its group (GROUP_ENV), the lighthouse
                            (LIGHTHOUSE_ENV) and its own handoff folder; then loads the trained weights and the
                            FitResult of the first group that finished
    a group's process       launches the group's workers (torch's elastic launcher, as ever) and leaves with their
                            outcome; a group of one process trains itself
    a worker                joins its group's world and the quorum (quorum_for); every rank reads the whole global
                            batch and trains the rows the quorum gives it

A group lost and started again by hand runs the same script with Trainer(..., replica_group=G, lighthouse=HOST:PORT)
(the address the launching process prints): it joins the running job at a step boundary, its state sent by a peer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from torch import nn

from paratrain.config import ConfigError, ParallelConfig
from paratrain.config.run import LaunchSection
from paratrain.config.plan import BatchLayout
from paratrain.config.validate import check_replica_batch
from paratrain.fit.launcher import HANDOFF_ENV, launch_workers, load_handoff, this_program
from paratrain.fit.result import FitResult
from paratrain.topology.context import Member
from paratrain.topology.quorum import Quorum, reach

GROUP_ENV = "PARATRAIN_FIT_REPLICA_GROUP"
"""Set for a replica group's processes (its launching process and its workers): the group's number."""

LIGHTHOUSE_ENV = "PARATRAIN_FIT_LIGHTHOUSE"
"""Set with GROUP_ENV: HOST:PORT of the store the replica groups meet at."""


def this_group() -> tuple[int, str] | None:
    """(group, lighthouse) in a process of a replica group, None elsewhere."""
    group = os.environ.get(GROUP_ENV)
    return None if group is None else (int(group), os.environ[LIGHTHOUSE_ENV])


def group_launch(launch: LaunchSection, groups_on_node: int) -> LaunchSection:
    """One replica group's launch: its share of the node's processes, a job inside the node."""
    return LaunchSection(nproc=launch.nproc // groups_on_node, device=launch.device, timeout_s=launch.timeout_s)


def launch_replica_groups(model: nn.Module | None, launch: LaunchSection, parallel: ParallelConfig, *,
                          replica_group: int | None, lighthouse: str, save: str | None,
                          fit_here: Callable[[], FitResult]) -> FitResult:
    """A fault-tolerant fit outside torchrun: in the launching process, start this node's groups (launch_groups); in
    a group's process, its workers (run_group; a group of one process trains here, fit_here, and leaves); by hand
    (replica_group=G with the lighthouse), group G alone, returning its result."""
    from paratrain.launch.replicas import node_groups

    one = group_launch(launch, len(node_groups(parallel.replica_groups, launch.nnodes, launch.node_rank)))
    if this_group() is not None:  # a group's own process
        if one.nproc == 1:
            return fit_here()  # hands over and leaves
        run_group(one, this_program(launch))
    if replica_group is None:
        return launch_groups(model, launch, parallel, this_program(launch))
    os.environ.update({GROUP_ENV: str(replica_group), LIGHTHOUSE_ENV: lighthouse})
    try:
        return launch_workers(model, one, max_restarts=0, save=save)
    finally:
        os.environ.pop(GROUP_ENV, None)
        os.environ.pop(LIGHTHOUSE_ENV, None)


def launch_groups(model: nn.Module | None, launch: LaunchSection, parallel: ParallelConfig,
                  command: list[str]) -> FitResult:
    """The launching process of a fault-tolerant fit: run `python *command` once per replica group of this node
    (paratrain.launch.replicas.node_groups), wait for them, and return the first finished group's FitResult (the
    trained weights loaded into `model`)."""
    from paratrain.launch.replicas import hold_lighthouse, node_groups, say_lost

    mine = node_groups(parallel.replica_groups, launch.nnodes, launch.node_rank)
    store, address = hold_lighthouse(launch)
    per_group = launch.nproc // len(mine)
    print(f"paratrain.Trainer: replica groups {list(mine)} of {parallel.replica_groups}, {per_group} process(es) "
          f"each, meet at the lighthouse {address}; a lost group starts again with this script and "
          f"Trainer(..., replica_group=G, lighthouse={address!r})", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-fit-groups-") as folder:
        children = []
        for g in mine:
            handoff = Path(folder) / f"group-{g}"
            handoff.mkdir()
            env = {**os.environ, GROUP_ENV: str(g), LIGHTHOUSE_ENV: address, HANDOFF_ENV: str(handoff)}
            children.append(subprocess.Popen([sys.executable, *command], env=env))
        codes = [child.wait() for child in children]
        lost = [g for g, code in zip(mine, codes) if code]
        say_lost(lost, mine, nodes=launch.nnodes, address=address, again="Trainer(..., replica_group=G, lighthouse=)")
        finished = [g for g, code in zip(mine, codes) if code == 0 and (Path(folder) / f"group-{g}" / "result.json").exists()]
        if not finished:
            raise RuntimeError(f"every replica group of this node was lost ({lost}; their errors are above): none "
                               "finished the run" + (", the other nodes' groups may go on" if launch.nnodes > 1 else ""))
        result = load_handoff(Path(folder) / f"group-{finished[0]}", model)
    del store  # the lighthouse goes with the job
    return result


def run_group(launch: LaunchSection, command: list[str]) -> None:
    """A replica group's own launching process: launch its workers and leave with their outcome (0, or 1 with the
    failure said), so that the code after fit runs in the job's launching process only."""
    from paratrain.launch import JobFailed, launch_script

    group, _ = this_group() or (-1, "")
    code = 0
    try:
        launch_script(launch, command)
    except JobFailed as failure:
        print(f"paratrain.Trainer: replica group {group}: {failure}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def quorum_for(member: Member, parallel: ParallelConfig, *, timeout_s: float, device: str) -> Quorum | None:
    """A worker's view of the replica groups under fault tolerance (None otherwise)."""
    if parallel.fault_tolerance != "replica":
        return None
    here = this_group()
    if here is None:
        raise ConfigError("fault_tolerance 'replica' under an external launcher (torchrun): each replica group is a "
                          "job of its own; run the script as `python script.py` and the Trainer starts them")
    group, lighthouse = here
    return reach(lighthouse, parallel, group=group, rank=member.rank, world=member.world_size, timeout_s=timeout_s,
                 device=device)


def check_replica_uses(*, accelerator: str, max_restarts: int, diloco_saves: bool) -> None:
    """What a Trainer's fault_tolerance='replica' does not compose with in this version, refused before launch, as
    `paratrain train` refuses it (check_replica_run). diloco_saves: save= under dp_mode diloco."""
    given = [what for what, on in (
        ("accelerator='cuda' (each group would number its GPUs from 0, and a joiner's state travels over gloo's CPU "
         "point-to-point)", accelerator == "cuda"),
        ("max_restarts (start a lost group again with replica_group=G, lighthouse='HOST:PORT': it joins the "
         "running job)", max_restarts > 0),
        ("save= with dp_mode diloco (each group's inner state is its own, and replica group 0 writes only its own)",
         diloco_saves)) if on]
    if given:
        raise ConfigError("fault_tolerance='replica' with " + "; ".join(given) + ": not built in this version; drop "
                          "them")


def check_replica_groups(parallel: ParallelConfig, batch: BatchLayout, *, num_nodes: int, replica_group: int | None,
                         lighthouse: str) -> None:
    """A Trainer's replica groups checked before launch: the batch each group takes, whole groups on each node, and
    replica_group= with lighthouse= (a group started again) both or neither."""
    check_replica_batch(parallel, batch.global_batch, batch.micro_batch)
    groups = parallel.replica_groups
    if groups % num_nodes:
        raise ConfigError(f"fault_tolerance='replica' runs whole replica groups on each node: replica_groups "
                          f"({groups}) must be a multiple of num_nodes ({num_nodes})")
    if (replica_group is not None) != bool(lighthouse) or not 0 <= (replica_group or 0) < groups:
        raise ConfigError(f"replica_group=G (0 .. {groups - 1}) starts one replica group of a running job and needs "
                          f"lighthouse='HOST:PORT' (its launching process prints it), got replica_group="
                          f"{replica_group}, lighthouse={lighthouse!r}: give both, or neither")
