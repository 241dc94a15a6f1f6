"""Mesh: one process group per parallel axis, built from ParallelDims and passed around explicitly.

Only axes of degree > 1 get a group: degree 1 is the plain single-process path, which never
communicates. Nothing here is stored in module globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from paratrain.topology.recorder import FlightRecorder
from paratrain.topology.dims import AXES, ParallelDims


SUB_AXES = ("dp_shard", "dp_replicate", "ep", "edp", "tied", "dp_cp", "edp_cp", "servers", "tp_row", "tp_col",
            "tp_depth", "tp_input", "tp_weight", "tp_output", "cp_ulysses", "cp_ring")
"""Groups inside the dp, tp or cp axis (or across pp's ends) whose degree is their group's size, 1 without one."""


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along one axis: what a collective needs, and what an error should name."""

    axis: str
    ranks: tuple[int, ...]
    """Global ranks of the group, in axis order."""
    index: int
    """This rank's position in `ranks`."""
    pg: dist.ProcessGroup
    recorder: FlightRecorder | None = None
    """This rank's flight recorder (shared by its groups), where paratrain.comm's collectives log."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        return f"the {self.axis} group (ranks {list(self.ranks)})"


@dataclass(frozen=True)
class Mesh:
    dims: ParallelDims
    rank: int
    groups: dict[str, AxisGroup]
    recorder: FlightRecorder | None = None
    """The collectives this rank issued on its groups (None: a single process, which issues none)."""

    @classmethod
    def build(cls, dims: ParallelDims, rank: int, *, timeout: timedelta | None = None) -> Mesh:
        """Create every axis's groups. Collective: every rank of the world must call it with the
        same dims, because torch's new_group is collective over the whole world.

        pp > 1 adds "tied": the first and last pipeline stage of each (dp, tp) position.
        ep E > 1 adds the dp sub-axes of expert parallelism: "ep" (E consecutive dp ranks dividing the
        experts among them) and, when E < dp, "edp" (dp / E ranks holding the same experts).
        dp_shard S with 1 < S < dp adds the dp sub-axes of hierarchical sharding: "dp_shard" (S ranks
        sharing one copy of the state) and "dp_replicate" (dp / S ranks holding the same shard).
        S = dp makes "dp_shard" the dp group itself; S = 1 adds nothing. Under cp a shard group is S dp
        ranks times their cp ranks (ZeRO's state is split over all the ranks holding the same parameters).
        cp > 1 adds "cp" (the ranks splitting one sequence) and "dp_cp" (dp x cp: the ranks holding the same
        parameters, which data parallelism reduces over and ZeRO shards over); with ep > 1 also "edp_cp"
        (edp x cp: the ranks holding the same experts); USP (cp_ulysses > 1) also "cp_ulysses" (consecutive cp
        ranks exchanging heads) and "cp_ring" (one rank of each such group: the ring).
        tp_mode 2d adds the grid's "tp_row" (the q ranks of one grid row) and "tp_col" (of one column); 2.5d with
        tp_depth > 1 also "tp_depth" (the ranks at one grid position of every stacked grid); 3d the cube's
        "tp_input", "tp_weight" and "tp_output" (paratrain.tensor_parallel.cube).
        Two or more dedicated parameter servers add "servers" (the ranks after the grid: a clock's norm is
        summed over them); the servers build the mesh too (new_group is collective over the world) and
        belong to no other group.
        """
        groups: dict[str, AxisGroup] = {}
        recorder = FlightRecorder(rank)

        def add(axis: str, all_ranks: list[list[int]]) -> None:
            for ranks in all_ranks:
                pg = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    groups[axis] = AxisGroup(axis, tuple(ranks), ranks.index(rank), pg, recorder)

        for axis in AXES:
            if dims.degree(axis) > 1:
                add(axis, dims.all_groups(axis))
        if dims.pp > 1:  # the first and last stage of each (dp, tp) position: a weight tied across them
            add("tied", [[group[0], group[-1]] for group in dims.all_groups("pp")])
        if dims.dp_shard < dims.dp and dims.shard_ranks > 1:  # a shard group: its dp ranks' cp ranks too
            shards, replicas = dims.data_split(dims.dp_shard)
            add("dp_shard", shards)
            add("dp_replicate", replicas)
        elif dims.dp_shard == dims.dp and "dp" in groups:
            groups["dp_shard"] = groups["dp"]
        if dims.data_axis != "dp":  # dp x cp
            add(dims.data_axis, dims.data_groups())
            if dims.dp_shard == dims.dp:  # ZeRO over all of dp x cp (plain dp: no strategy reads dp_shard)
                groups["dp_shard"] = groups[dims.data_axis]
        if dims.cp_ulysses > 1:
            inner, ring = dims.cp_split()
            add("cp_ulysses", inner)
            add("cp_ring", ring)
        for axis, ranks_of_axis in dims.tp_sub_axes().items():  # a grid's rows and columns, a cube's three axes
            add(axis, ranks_of_axis)
        if dims.servers > 1:
            add("servers", [list(range(dims.grid_size, dims.world_size))])
        for axis, ranks_of_axis in dims.expert_axes().items():  # ep, edp, edp x cp
            add(axis, ranks_of_axis)
        return cls(dims=dims, rank=rank, groups=groups, recorder=recorder)

    @classmethod
    def single(cls) -> Mesh:
        return cls(dims=ParallelDims(), rank=0, groups={})

    def close(self) -> None:
        """Destroy this rank's process groups of the mesh (each gloo group holds threads and sockets); the world's
        group stays. Nothing may communicate over the mesh afterwards. Local: no rank waits for another."""
        for pg in {id(g.pg): g.pg for g in self.groups.values()}.values():
            dist.destroy_process_group(pg)

    def degree(self, axis: str) -> int:
        if axis in SUB_AXES:
            return self.groups[axis].size if axis in self.groups else 1
        return self.dims.degree(axis)

    def index(self, axis: str) -> int:
        """This rank's coordinate along `axis`."""
        if axis in SUB_AXES:
            return self.groups[axis].index if axis in self.groups else 0
        return self.dims.coords(self.rank)[axis]

    def data_group(self) -> AxisGroup | None:
        """The ranks a replicated parameter's gradient, and a step's loss and token count, are summed
        over: dp, or dp x cp under context parallelism (None: one such rank); under DiLoCo (dims.dp_local)
        those of this rank's replica group only (its dp_shard ranks, x cp)."""
        if self.dims.dp_local:
            if self.dims.shard_ranks == 1:
                return None  # a replica group of one rank
            return self.groups["dp_shard"]
        return self.groups.get(self.dims.data_axis)

    def replica_group(self) -> AxisGroup | None:
        """Under DiLoCo (dims.dp_local): the ranks at this rank's place in every replica group, which hold the
        same parameters (or ZeRO shard) at an outer step; None otherwise."""
        if not self.dims.dp_local:
            return None
        if "dp_replicate" in self.groups:
            return self.groups["dp_replicate"]
        return self.groups["dp"]  # replica groups of one dp rank each, without cp: the dp group links them

    def expert_data_group(self) -> AxisGroup | None:
        """The ranks an expert's gradient is summed over: those holding the same experts (edp), times cp
        under context parallelism (None: no other rank holds them)."""
        return self.groups.get("edp_cp", self.groups.get("edp"))

    def group(self, axis: str) -> AxisGroup:
        if axis not in self.groups:
            raise ValueError(
                f"axis {axis!r} has degree {self.degree(axis)}, so it has no process group: "
                "degree 1 is the plain path and must not communicate"
            )
        return self.groups[axis]
