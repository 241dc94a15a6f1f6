"""At run time, a collective that times out names the group and the operation instead of hanging, and
the ranks' flight recorders say who never entered it."""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

import paratrain
from paratrain.comm import CollectiveError, all_reduce
from paratrain.topology.recorder import hang_report


def _only_rank0_reduces() -> dict:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=2), timeout=timedelta(seconds=2))
    all_reduce(torch.ones(1), ctx.mesh.group("dp"))  # both ranks: collective #1 on dp
    message = ""
    if dist.get_rank() == 0:  # rank 1 never enters #2
        try:
            all_reduce(torch.ones(3), ctx.mesh.group("dp"))
        except CollectiveError as error:
            message = str(error)
    assert ctx.mesh.recorder is not None
    return {"message": message, "record": ctx.mesh.recorder.to_dict(stack=f"  File 'job.py', rank {ctx.rank} here")}


def test_timeout_names_group_and_operation(pools, tmp_path):
    got = pools(2).run(_only_rank0_reduces, timeout=60)
    pools.drop(2)  # the abandoned collective leaves that world in no state to reuse
    assert ("all_reduce (#2 on this group) of (3,) torch.float32 on the dp group (ranks [0, 1]) failed on global "
            "rank 0") in got[0]["message"]
    for result in got:
        (tmp_path / f"rank{result['record']['rank']}.json").write_text(json.dumps(result["record"]))
    report = hang_report(tmp_path)
    assert report == ["rank 1 never entered all_reduce #2 on the dp group (ranks [0, 1]), where rank 0 waited; its "
                      "last collective there is #1 (all_reduce, done); its stack:\n  File 'job.py', rank 1 here"]
