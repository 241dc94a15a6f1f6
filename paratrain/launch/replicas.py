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

from paratrain.config import RunConfig, RunPlan, write_run


def launch_replica_groups(config: RunConfig, plan: RunPlan) -> int:
    import torch.distributed as dist

    groups = plan.parallel.replica_groups
    per_group = config.launch.nproc // groups
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=max(60.0, config.launch.timeout_s)))
    address = f"127.0.0.1:{store.port}"
    print(f"paratrain: {groups} replica groups of {per_group} processes meet at the lighthouse {address}; a lost "
          f"group starts again with the same command and --nproc {per_group} --replica-group G --lighthouse {address}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-replicas-") as folder:
        children = []
        for g in range(groups):
            launch = dataclasses.replace(config.launch, nproc=per_group, replica_group=g, lighthouse=address)
            run_file = write_run(dataclasses.replace(config, launch=launch,
                                                     parallel=dataclasses.replace(config.parallel, dp=plan.parallel.dp)),
                                 Path(folder) / f"group-{g}.json")
            children.append(subprocess.Popen([sys.executable, "-m", "paratrain", "replica-group", "--run-plan",
                                              str(run_file)]))
        codes = [child.wait() for child in children]
    lost = [g for g, code in enumerate(codes) if code]
    if lost and len(lost) < groups:
        print(f"paratrain: replica group(s) {lost} were lost; the others finished the run", file=sys.stderr, flush=True)
    del store  # the lighthouse goes with the job
    return 0 if len(lost) < groups else 1
