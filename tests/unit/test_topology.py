from __future__ import annotations

import itertools

import pytest

from paratrain.topology import Mesh, ParallelDims


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (1, 4, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2), (3, 2, 1)])
def test_rank_coordinates_round_trip(pp, dp, tp):
    dims = ParallelDims.of(dp=dp, tp=tp, pp=pp)
    seen = set()
    for rank in range(dims.world_size):
        coords = dims.coords(rank)
        assert dims.rank(**coords) == rank
        seen.add(tuple(coords.values()))
    assert len(seen) == dims.world_size


def test_tp_is_innermost():
    dims = ParallelDims.of(dp=2, tp=2, pp=2)
    assert dims.group_ranks("tp", 0) == [0, 1]
    assert dims.group_ranks("dp", 0) == [0, 2]
    assert dims.group_ranks("pp", 0) == [0, 4]
    assert dims.coords(7) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}


@pytest.mark.parametrize("axis", ["pp", "dp", "tp"])
def test_groups_partition_the_world(axis):
    dims = ParallelDims.of(dp=2, tp=2, pp=3)
    groups = dims.all_groups(axis)
    flat = list(itertools.chain.from_iterable(groups))
    assert sorted(flat) == list(range(dims.world_size))
    assert all(len(g) == dims.degree(axis) for g in groups)
    for group in groups:
        for rank in group:
            assert dims.group_ranks(axis, rank) == group


def test_bad_ranks_and_axes():
    dims = ParallelDims.of(dp=2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        dims.coords(2)
    with pytest.raises(ValueError, match="unknown axis"):
        dims.degree("xp")


def test_single_mesh_refuses_degree_one_groups():
    mesh = Mesh.single()
    assert mesh.degree("dp") == 1 and mesh.index("dp") == 0
    with pytest.raises(ValueError, match="degree 1"):
        mesh.group("dp")


def test_dp_split_for_hierarchical_sharding():
    dims = ParallelDims.of(dp=4, tp=2)
    shards, replicas = dims.dp_split(2)
    # dp groups are [0, 2, 4, 6] and [1, 3, 5, 7] (tp innermost)
    assert shards == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert replicas == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(Exception, match="must divide dp"):
        dims.dp_split(3)


def test_every_axis_is_named_and_checked_once():
    """dp = dp_replicate x dp_shard (ZeRO's shard group), ep inside dp, cp an axis of its own; a resolved
    config gives the dims without resolving again."""
    from paratrain.config import ConfigError, ParallelConfig

    dims = ParallelDims.of(dp=4, tp=2, dp_shard=2, ep=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.world_size) == (4, 2, 2, 8)
    resolved = ParallelConfig(tp=2, zero=1, shard_group=2).resolved(8)
    assert ParallelDims.from_config(resolved) == dims.__class__(dp_replicate=2, dp_shard=2, tp=2)
    assert ParallelDims.from_config(ParallelConfig(dp=4).resolved(4)).dp_shard == 1  # no ZeRO: replicated
    assert ParallelDims.from_config(ParallelConfig(zero=2).resolved(4)).dp_shard == 4
    with pytest.raises(ConfigError, match="not resolved yet"):
        ParallelDims.from_config(ParallelConfig())
    assert ParallelDims.from_config(ParallelConfig(cp=2).resolved(4)) == ParallelDims(dp_replicate=2, cp=2)
    with pytest.raises(ConfigError, match=r"ep \(3\) must divide dp \(4\)"):
        ParallelDims.of(dp=4, ep=3)
    with pytest.raises(ConfigError, match="tp must be >= 1, got 0"):
        ParallelDims(tp=0)


def test_the_cp_axis_sits_between_tp_and_dp_and_data_parallelism_spans_dp_x_cp():
    """Rank order tp, cp, dp, pp (innermost first, as Megatron-LM); the ranks holding the same parameters are
    every (dp, cp) pair of a (pp, tp) position."""
    from paratrain.topology.dims import ParallelDims

    dims = ParallelDims.of(dp=2, cp=2, tp=2)
    assert dims.world_size == 8
    assert [dims.rank(**dims.coords(r)) for r in range(8)] == list(range(8))
    assert dims.coords(3) == {"pp": 0, "dp": 0, "cp": 1, "tp": 1}
    assert dims.all_groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.all_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.data_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_cp_composes_with_every_axis_and_names_a_bad_mode():
    """cp composes with pp, ep and hierarchical sharding (a shard group spans its dp ranks' cp ranks:
    data_split); an unknown cp_mode is refused by name."""
    from paratrain.config import ParallelConfig
    from paratrain.config.errors import ConfigError

    with pytest.raises(ConfigError, match="cp_mode"):
        ParallelConfig(cp=2, cp_mode="stripes").resolved(8)
    for given in (dict(cp=2, pp=2), dict(cp=2, ep=2), dict(cp=2, zero=1, shard_group=1)):
        ParallelConfig(**given).resolved(8)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, ep=2)  # dp 4: ranks dp index x 2 + cp index
    shards, replicas = dims.data_split(2)
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]] and replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.expert_data_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # dp indices e, e + 2 times every cp
    assert ParallelConfig(cp=2, zero=3).resolved(8).dp == 4


@pytest.mark.parametrize("dims", [ParallelDims.of(dp=4, tp=2, cp=2, pp=2, ep=2, dp_shard=2),
                                  ParallelDims.of(dp=2, tp=1, cp=4, pp=1, dp_shard=2), ParallelDims.of(dp=8, ep=4)])
def test_the_planners_accessors_are_the_groups_sizes_and_order(dims):
    """What the planner reads of ParallelDims (replicas, expert_replicas, shard_ranks, shard_index, inside) is what the
    groups the mesh builds hold: their sizes, each rank's place in its shard group, and how far a group strides."""
    assert dims.replicas == len(dims.data_groups()[0])
    assert dims.expert_replicas == len(dims.expert_data_groups()[0])
    shard_groups, _ = dims.data_split(dims.dp_shard)
    assert dims.shard_ranks == len(shard_groups[0])
    for group in shard_groups:
        assert [dims.shard_index(dims.coords(rank)) for rank in group] == list(range(len(group)))
    for group in dims.expert_data_groups():
        assert [dims.expert_shard_index(dims.coords(rank)) for rank in group] == list(range(len(group)))
    for axis in ("pp", "dp", "cp", "tp"):
        group = dims.all_groups(axis)[0]
        assert all(b - a == dims.inside(axis) for a, b in zip(group, group[1:])), axis
