"""`srun paratrain train` takes the node count, its node rank and the rendezvous from SLURM's variables."""

from __future__ import annotations

import pytest

from paratrain.config import ConfigError
from paratrain.launch.slurm import expand_nodelist, slurm_overrides


def test_nodelists_expand():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_launch_settings_from_slurm():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "4", "SLURM_NTASKS": "4",
           "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[10-13]", "MASTER_PORT": "31000"}
    assert slurm_overrides(env) == {"launch.nnodes": 4, "launch.node_rank": 2, "launch.rdzv_endpoint": "gpu10:31000",
                                    "launch.rdzv_id": "slurm-4242"}
    assert slurm_overrides({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2"}) == {}  # salloc's shell: not a job step
    with pytest.raises(ConfigError, match="one task per node.* SLURM_NTASKS = 16 over SLURM_NNODES = 2"):
        slurm_overrides({**env, "SLURM_NNODES": "2", "SLURM_NTASKS": "16"})
