"""The rules of replica groups, before launch: DiLoCo's (dp_mode 'diloco') and fault tolerance's (fault_tolerance
'replica'), each refused with its rule; and what a run with them cannot do yet, by name."""

from __future__ import annotations

import pytest

import paratrain
from paratrain.cli import main


def test_diloco_refusals():
    bad = {"replica_groups 3 of dp 4": dict(dp=4, dp_mode="diloco", replica_groups=3),
           "one group": dict(dp=4, dp_mode="diloco", replica_groups=1),
           "inner steps 0": dict(dp=4, dp_mode="diloco", replica_groups=2, inner_steps=0),
           "momentum 1": dict(dp=4, dp_mode="diloco", replica_groups=2, outer_momentum=1.0),
           "shard group across groups": dict(dp=4, zero=1, shard_group=4, dp_mode="diloco", replica_groups=2),
           "ep": dict(dp=4, ep=2, dp_mode="diloco", replica_groups=2),
           "groups without diloco": dict(dp=4, replica_groups=2),
           "fragments not dividing H": dict(dp=4, dp_mode="diloco", replica_groups=2, inner_steps=4, outer_fragments=3)}
    for what, fields in bad.items():
        with pytest.raises(paratrain.ConfigError) as error:
            paratrain.ParallelConfig(**fields).resolved(4)
        assert "diloco" in str(error.value).lower() or "DiLoCo" in str(error.value), what
    paratrain.ParallelConfig(dp=4, zero=1, shard_group=2, dp_mode="diloco", replica_groups=2).resolved(4)


@pytest.mark.parametrize("fields, message", [
    (dict(dp=4, fault_tolerance="replica", replica_groups=3), "replica_groups (3) must divide dp"),
    (dict(dp=4, fault_tolerance="replica", replica_groups=1), "replica_groups (1) must divide dp"),
    (dict(dp=4, zero=1, shard_group=4, fault_tolerance="replica", replica_groups=2), "shard_group (4) must be 2"),
    (dict(dp=4, ep=4, fault_tolerance="replica", replica_groups=2), "ep (4) must divide the group's dp"),
    (dict(dp=4, fault_tolerance="replica", replica_groups=2, dp_mode="diloco", inner_steps=4, outer_fragments=2),
     "with dp_mode diloco with outer_fragments > 1"),
    (dict(dp=4, fault_tolerance="sometimes"), "fault_tolerance must be one of"),
])
def test_fault_tolerance_refusals(fields, message):
    with pytest.raises(paratrain.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        paratrain.ParallelConfig(**fields).resolved(4)
    paratrain.ParallelConfig(dp=4, zero=3, fault_tolerance="replica", replica_groups=2).resolved(4)


SMALL = ["train", "--nproc", "4", "--model", "tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "6", "--fault-tolerance", "replica", "--replica-groups", "3", "--global-batch", "6", "--micro-batch",
      "1"], "with 2 of 3 groups left that is 4 x 1 rows"),
    (["--fault-tolerance", "replica", "--replica-groups", "2", "--global-batch", "8", "--max-restarts", "1",
      "--save", "/tmp/x"], "--max-restarts"),
    (["--nproc", "2", "--fault-tolerance", "replica", "--replica-groups", "2", "--global-batch", "8", "--replica-group",
      "1"], "needs --lighthouse"),
    (["--fault-tolerance", "replica", "--replica-groups", "2", "--global-batch", "16", "--batch-rampup", "8,8,64"],
     "--batch-rampup"),
    (["--nproc", "3", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--fault-tolerance", "replica",
      "--replica-groups", "3", "--global-batch", "12", "--micro-batch", "1"],
     "replica_groups (3) must be a multiple of the nodes (2, --nnodes): give --replica-groups 2 or a multiple of it"),
    (["--dp-mode", "diloco", "--replica-groups", "2", "--global-batch", "8", "--optimizer", "muon"], "Muon"),
    (["--dp-mode", "diloco", "--replica-groups", "2", "--global-batch", "8", "--plan", "auto"], "--plan auto"),
])
def test_runs_with_replica_groups_refuse_what_they_cannot_do(capsys, flags, message):
    assert main([*SMALL, *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (dict(global_batch=6, micro_batch=1, replica_groups=3, devices=6), "with 2 of 3 groups left that is 4 x 1 rows"),
    (dict(strategy=paratrain.ParallelConfig(zero=2, dp_mode="diloco", inner_steps=2), save="/tmp/x"),
     "save= with dp_mode diloco"),
    (dict(max_restarts=1, save="/tmp/x"), "max_restarts"),
    (dict(replica_group=1), "needs lighthouse='HOST:PORT'"),
    (dict(replica_group=2, lighthouse="127.0.0.1:1"), "replica_group=G (0 .. 1)"),
])
def test_a_trainer_with_replica_groups_refuses_what_it_cannot_do(options, message):
    """Trainer(fault_tolerance="replica"): the CLI's rules, before any process starts."""
    settings = {**dict(devices=4, strategy="zero2", max_steps=2, global_batch=8, fault_tolerance="replica"), **options}
    with pytest.raises(paratrain.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        paratrain.Trainer(**settings)
    paratrain.Trainer(devices=4, strategy="zero2", max_steps=2, global_batch=8, fault_tolerance="replica")


class _Groups:
    """A stand-in for the replica groups' quorum: the other groups' first loss scales, reduced as Quorum.reduce does."""

    def __init__(self, others: list[float]) -> None:
        self.others: list[float] = others
        self.ops: list[object] = []

    def reduce(self, tensors: list, *, op: object = None) -> None:
        import torch.distributed as dist

        self.ops.append(op)
        for tensor in tensors:
            values = [float(tensor.item()), *self.others]
            tensor.fill_(min(values) if op == dist.ReduceOp.MIN else sum(values))


def test_fp16_under_replica_groups_takes_the_smallest_first_scale_of_every_group():
    """fp16 under fault_tolerance 'replica': each step sums the groups' scaled gradients, so the first scale (from a
    micro-batch's token count) is the smallest over the replica groups as well as the dp ranks; a group with fewer
    tokens would otherwise scale by twice another's and the sum mix both. Later steps ask no group."""
    import torch
    import torch.distributed as dist

    from paratrain.memory.precision import POLICIES

    groups = _Groups(others=[2.0**8])  # another group's first micro-batch: 256 tokens
    scaler = POLICIES["fp16"].scaler(None, across=groups)
    assert scaler.initial(100.0) == 2.0**9  # 100 tokens alone: 2^16 / 100, down to a power of two
    assert scaler.agreed(100.0, torch.device("cpu"), None) == 2.0**8 and groups.ops == [dist.ReduceOp.MIN]
    assert scaler.agreed(100.0, torch.device("cpu"), None) == 2.0**8 and len(groups.ops) == 1
    assert POLICIES["fp16"].scaler(None).across is None and POLICIES["bf16"].scaler(None, across=groups) is None
