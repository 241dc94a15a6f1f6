"""At run time, a collective that times out names the group and the operation instead of hanging."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import paratrain
from paratrain.comm import CollectiveError, all_reduce


def _only_rank0_reduces() -> str:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=2), timeout=timedelta(seconds=2))
    if dist.get_rank() != 0:
        return ""
    try:
        all_reduce(torch.ones(3), ctx.mesh.group("dp"))
    except CollectiveError as error:
        return str(error)
    return "no error"


def test_timeout_names_group_and_operation(pools):
    message = pools(2).run(_only_rank0_reduces, timeout=60)[0]
    assert "all_reduce of (3,) torch.float32 on the dp group (ranks [0, 1]) failed on global rank 0" in message
    pools.close()  # the abandoned collective leaves that world in no state to reuse
