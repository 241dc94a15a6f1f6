"""ParallelDims: the degree of every parallel axis, and where each rank sits on them. Pure Python, no
torch.distributed.

The ranks form a (pp, dp, cp, tp) grid; rank order puts tp innermost, then cp, then dp, then pp (as
Megatron-LM): the ranks of one tp group are adjacent, so on a multi-GPU node they share the fastest
links, and a cp ring is the next closest.

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

The other axes live inside these: dp = dp_replicate x dp_shard (ZeRO's state split over dp_shard
consecutive dp ranks, replicated over the dp_replicate groups; without ZeRO dp_shard is 1), ep
consecutive dp ranks dividing the experts (ep folds into dp), virtual_stages chunks per pipeline rank.
Parameters are whole on every cp rank, so what data parallelism reduces runs over dp x cp
(data_groups). Dedicated parameter servers (paratrain.param_server) are `servers` more ranks after the
grid: ranks grid_size .. world_size - 1. Which ranks form each axis's groups is its base class's,
paratrain.topology.groups.RankGroups.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Mapping

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig
from paratrain.config.rules import check_divides_dp, check_expert_parallel, check_grid_shape, check_usp, grid_side
from paratrain.topology.groups import AXES, RankGroups

@dataclass(frozen=True)
class ParallelDims(RankGroups):
    """The degree of each axis; built once per process (Context.dims) and read by the mesh, the
    strategies and the planner."""

    pp: int = 1
    virtual_stages: int = 1
    """Chunks per pipeline rank (the interleaved schedule)."""
    dp_replicate: int = 1
    """Data-parallel groups holding the same state (plain data parallelism: all of dp)."""
    dp_shard: int = 1
    """Consecutive dp ranks that split one copy of ZeRO's state (1 without ZeRO)."""
    ep: int = 1
    """Consecutive dp ranks dividing each MoE layer's experts: a sub-axis of dp."""
    tp: int = 1
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (paratrain.context_parallel)."""
    servers: int = 0
    """Dedicated parameter servers, ranks after the grid (0: none, or colocated on the trainers)."""
    tp_mode: str = "1d"
    """How tp splits the layers: '1d' (Megatron's column / row slices), '2d' (a q x q grid, tp = q^2: the tp ranks
    laid out row by row, tp_index = row * q + column), '2.5d' (tp_depth such grids, tp = d q^2, tp_index =
    depth * q^2 + row * q + column; paratrain.tensor_parallel.grid) or '3d' (a q x q x q cube, tp_index =
    input * q^2 + weight * q + output; paratrain.tensor_parallel.cube)."""
    tp_depth: int = 1
    """2.5d: the grids stacked (d), each on its own share of the batch rows."""
    cp_ulysses: int = 1
    """USP (cp_mode 'usp'): the consecutive cp ranks of one Ulysses group, the ring passing blocks across the
    cp / cp_ulysses groups (cp_split); 1 otherwise."""
    dp_local: bool = False
    """DiLoCo (dp_mode 'diloco'): the dp_replicate groups train apart, each summing its gradients over its own
    dp_shard ranks (x cp) only, and meet at outer steps over dp_replicate (Mesh.data_group, Mesh.replica_group)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("tp_mode", "dp_local") and getattr(self, f.name) < (0 if f.name == "servers" else 1):
                raise ConfigError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        check_grid_shape(self.tp_mode, self.tp, self.tp_depth)
        check_expert_parallel(self.ep, self.dp)
        if self.cp_ulysses > 1:
            check_usp(self.cp, "usp", self.cp_ulysses)

    @classmethod
    def of(cls, *, dp: int = 1, tp: int = 1, pp: int = 1, virtual_stages: int = 1, ep: int = 1,
           dp_shard: int = 1, cp: int = 1, servers: int = 0, tp_mode: str = "1d", tp_depth: int = 1,
           cp_ulysses: int = 1, dp_local: bool = False) -> ParallelDims:
        """From the data-parallel degree as a whole, split into dp / dp_shard replicas of dp_shard ranks."""
        if dp < 1:
            raise ConfigError(f"dp must be >= 1, got {dp}")
        check_divides_dp("shard group", dp_shard, dp)
        return cls(pp=pp, virtual_stages=virtual_stages, dp_replicate=dp // dp_shard, dp_shard=dp_shard, ep=ep,
                   tp=tp, cp=cp, servers=servers, tp_mode=tp_mode, tp_depth=tp_depth, cp_ulysses=cp_ulysses,
                   dp_local=dp_local)

    @classmethod
    def from_config(cls, config: ParallelConfig) -> ParallelDims:
        """The dims of a config already resolved against its world size (ParallelConfig.resolved):
        read, not resolved again. ZeRO shards over shard_group dp ranks (all of dp without one); DiLoCo's replica
        groups are the dp_replicate groups, whatever the ZeRO stage (each group's dp / replica_groups ranks the
        dp_shard ranks)."""
        if config.dp is None:
            raise ConfigError("dp is not resolved yet: call ParallelConfig.resolved(world_size) first")
        local = config.dp_mode == "diloco"
        if config.fault_tolerance == "replica":  # each replica group is a world of its own: its dims are its own
            dp = config.dp // config.replica_groups
            return cls.of(dp=dp, tp=config.tp, pp=config.pp, virtual_stages=config.virtual_stages, ep=config.ep,
                          dp_shard=dp if config.zero else 1, cp=config.cp, servers=config.ps_servers,
                          tp_mode=config.tp_mode, tp_depth=config.tp_depth, cp_ulysses=config.cp_ulysses)
        shard = config.dp // config.replica_groups if local else (config.shard_group or config.dp) if config.zero else 1
        return cls.of(dp=config.dp, tp=config.tp, pp=config.pp, virtual_stages=config.virtual_stages, ep=config.ep,
                      dp_shard=shard, cp=config.cp, servers=config.ps_servers, tp_mode=config.tp_mode,
                      tp_depth=config.tp_depth, cp_ulysses=config.cp_ulysses, dp_local=local)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def experts_split(self) -> bool:
        """Whether expert parallelism splits the experts among ranks (ep > 1)."""
        return self.ep > 1

    def experts_of(self, experts: int) -> int:
        """The experts of a layer of `experts` one rank holds: experts / ep."""
        return experts // self.ep

    def expert_index(self, dp_index: int) -> int:
        """Which share of the experts dp rank `dp_index` holds (an ep group is ep consecutive dp ranks)."""
        return dp_index % self.ep

    @property
    def tp_grid(self) -> bool:
        """Whether tp cuts each layer over a grid of ranks (tp_mode 2d, 2.5d or 3d) rather than along one dimension."""
        return self.tp_mode != "1d"

    @property
    def tp_cube(self) -> bool:
        """Whether that grid is a q x q x q cube (tp_mode 3d)."""
        return self.tp_mode == "3d"

    @property
    def tp_shape(self) -> tuple[str, int, int, int]:
        """(tp_mode, tp, grid_side, tp_depth): how tp cuts each layer, whole."""
        return self.tp_mode, self.tp, self.grid_side, self.tp_depth

    @property
    def grid_side(self) -> int:
        """q of a 2d / 2.5d tensor-parallel grid (tp_depth x q x q = tp ranks) or a 3d cube (q^3); 1 under 1d."""
        return grid_side(self.tp_mode, self.tp, self.tp_depth)

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters at one (pp, tp) place, what a dense gradient is summed over: dp x cp
        (a data group's size: cp ranks hold whole parameters and each reads its part of the sequences)."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """The ranks holding the same experts at one (pp, tp, ep) place: dp / ep x cp (an expert data group's size)."""
        return self.dp // self.ep * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks one copy of ZeRO's state is split over: dp_shard x cp (a shard group's size)."""
        return self.dp_shard * self.cp

    @property
    def sequence_parts(self) -> int:
        """The ranks each sequence is split over (context parallelism): a rank holds seq / sequence_parts tokens."""
        return self.cp

    @property
    def data_axis(self) -> str:
        """The mesh's name for the ranks of a data group (data_groups): "dp", or "dp_cp" under context parallelism."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def expert_data_axis(self) -> str:
        """The mesh's name for the ranks of an expert data group (expert_data_groups): "edp", or "edp_cp" under
        context parallelism."""
        return "edp_cp" if self.cp > 1 else "edp"

    def shard_index(self, coords: Mapping[str, int]) -> int:
        """A rank's index (its coords) in its ZeRO shard group of shard_ranks ranks: dp_shard x cp, dp index outer
        (paratrain.topology.mesh's dp_shard group, data_split's order)."""
        return (coords["dp"] % self.dp_shard) * self.cp + coords["cp"]

    def expert_shard_index(self, coords: Mapping[str, int]) -> int:
        """A rank's index in its expert data group of expert_replicas ranks: dp / ep x cp, dp index outer."""
        return (coords["dp"] // self.ep) * self.cp + coords["cp"]

    def parameter_slices(self) -> ParallelDims:
        """These dims with only the axes that cut parameters: pp, tp and ep (a dp of ep ranks, unsharded); the rest
        of dp, cp and the servers at 1."""
        return replace(self, dp_replicate=self.ep, dp_shard=1, cp=1, cp_ulysses=1, servers=0)

    def inside(self, axis: str) -> int:
        """The ranks inside one index of `axis` in rank order (the degrees of the axes inner to it): a group of
        `axis` strides this far, and a group of the axes inner to it spans this many consecutive ranks."""
        inner = 1
        for name in reversed(AXES):
            if name == axis:
                return inner
            inner *= self.degree(name)
        raise ValueError(f"unknown axis {axis!r}: choose one of {AXES}")

    @property
    def grid_size(self) -> int:
        """The ranks of the (pp, dp, cp, tp) grid: the trainers."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        """Every rank: the grid's and the dedicated parameter servers'."""
        return self.grid_size + self.servers

    def is_server(self, rank: int) -> bool:
        """Whether `rank` is a dedicated parameter server (after the grid)."""
        return self.grid_size <= rank < self.world_size

    def degree(self, axis: str) -> int:
        """The degree of a grid axis ('pp', 'dp', 'cp', 'tp')."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}: choose one of {AXES}")
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp': i, 'dp': j, 'cp': c, 'tp': k} of a global rank."""
        self._check_rank(rank)
        coords = {}
        for axis in reversed(AXES):  # innermost first
            coords[axis] = rank % self.degree(axis)
            rank //= self.degree(axis)
        return {axis: coords[axis] for axis in AXES}

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        rank = 0
        for axis, index in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= index < self.degree(axis):
                raise ValueError(f"{axis} index {index} out of range 0..{self.degree(axis) - 1}")
            rank = rank * self.degree(axis) + index
        return rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.grid_size:
            where = " (a parameter server: it has no place on the grid)" if self.is_server(rank) else ""
            raise ValueError(f"rank {rank} out of range for the grid of {self.grid_size} ranks{where}")
