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
grid: ranks grid_size .. world_size - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import product
from typing import Mapping

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig
from paratrain.config.rules import check_divides_dp, check_expert_parallel, check_grid_shape, check_usp, grid_side

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""The axes of the rank grid, outermost first."""


@dataclass(frozen=True)
class ParallelDims:
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

    def expert_axes(self) -> dict[str, list[list[int]]]:
        """Expert parallelism's axes and every group of each, as the mesh builds them: "ep" (its own process group
        even when ep = dp: the all-to-alls in backward must not interleave with the gradient all-reduces GradSync
        starts on dp meanwhile), "edp" (the ranks holding the same experts) when ep < dp, and under cp "edp_cp"
        (edp x cp); none without ep."""
        if not self.experts_split:
            return {}
        experts, replicas = self.dp_split(self.ep)
        axes = {"ep": experts, **({"edp": replicas} if self.ep < self.dp else {})}
        if self.expert_data_axis != "edp":
            axes[self.expert_data_axis] = self.expert_data_groups()
        return axes

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

    def tp_sub_axes(self) -> dict[str, list[list[int]]]:
        """The grid's sub-axes of tp and every group of each, as the mesh builds them: "tp_row" and "tp_col" (and
        "tp_depth" with tp_depth > 1) of 2d / 2.5d, "tp_input", "tp_weight" and "tp_output" of the cube; none
        under 1d."""
        if not self.tp_grid:
            return {}
        if self.tp_cube:
            return dict(zip(("tp_input", "tp_weight", "tp_output"), self.tp_cube_groups()))
        rows, cols, depths = self.tp_grid_groups()
        return {"tp_row": rows, "tp_col": cols, **({"tp_depth": depths} if self.tp_depth > 1 else {})}

    @property
    def grid_side(self) -> int:
        """q of a 2d / 2.5d tensor-parallel grid (tp_depth x q x q = tp ranks) or a 3d cube (q^3); 1 under 1d."""
        return grid_side(self.tp_mode, self.tp, self.tp_depth)

    def tp_cube_groups(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(input, weight, output) groups of every tp group laid out as a q x q x q cube, tp_index = a q^2 + b q + c:
        an input group varies a, a weight group b, an output group c (the consecutive ranks)."""
        q = self.grid_side
        axes: tuple[list[list[int]], list[list[int]], list[list[int]]] = ([], [], [])
        for ranks in self.all_groups("tp"):
            for fixed in product(range(q), range(q)):
                for axis, groups in enumerate(axes):
                    coords = list(fixed)
                    groups.append([ranks[sum(c * q ** (2 - n) for n, c in enumerate(coords[:axis] + [v] + coords[axis:]))]
                                   for v in range(q)])
        return axes

    def cp_split(self) -> tuple[list[list[int]], list[list[int]]]:
        """(Ulysses groups, ring groups) of every cp group under USP: a Ulysses group is cp_ulysses consecutive cp
        ranks (cp index i in group i // cp_ulysses at place i % cp_ulysses), a ring group every cp_ulysses-th
        (the ranks at one place of every Ulysses group, in cp order)."""
        u = self.cp_ulysses
        inner, ring = [], []
        for ranks in self.all_groups("cp"):
            inner += [ranks[g * u:(g + 1) * u] for g in range(self.cp // u)]
            ring += [ranks[at::u] for at in range(u)]
        return inner, ring

    def tp_grid_groups(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(row groups, column groups, depth groups) of every tp group laid out as tp_depth q x q grids, each row
        by row: a row group is q consecutive tp ranks (one grid row, its column index varying), a column group
        every q-th of one grid, a depth group the ranks at one (row, column) of every grid."""
        q, d = self.grid_side, self.tp_depth
        rows, cols, depths = [], [], []
        for ranks in self.all_groups("tp"):
            for k in range(d):
                grid = ranks[k * q * q:(k + 1) * q * q]
                rows += [grid[r * q:(r + 1) * q] for r in range(q)]
                cols += [grid[c::q] for c in range(q)]
            depths += [ranks[at::q * q] for at in range(q * q)]
        return rows, cols, depths

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

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks that share every coordinate of `rank` except `axis`, in axis order."""
        coords = self.coords(rank)
        return [self.rank(**{**coords, axis: i}) for i in range(self.degree(axis))]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each listed once, in a fixed order all ranks agree on."""
        others = [a for a in AXES if a != axis]
        groups = []
        for indices in product(*(range(self.degree(a)) for a in others)):
            fixed = dict(zip(others, indices))
            groups.append([self.rank(**{**fixed, axis: i}) for i in range(self.degree(axis))])
        return groups

    def data_groups(self) -> list[list[int]]:
        """The ranks holding the same parameters' replicas over dp and cp (every (pp, tp) position), dp
        index outer, cp inner: what data parallelism reduces over when cp > 1."""
        groups = []
        for pp, tp in product(range(self.pp), range(self.tp)):
            groups.append([self.rank(pp=pp, dp=d, cp=c, tp=tp) for d in range(self.dp) for c in range(self.cp)])
        return groups

    def data_split(self, shard: int) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replicate groups) of dp x cp for hierarchical sharding under context parallelism:
        a shard group is `shard` consecutive dp indices times every cp index (shard x cp ranks holding one
        copy of the state), a replicate group the ranks at the same (dp index mod shard, cp index) of
        every shard group. At cp 1 this is dp_split(shard)."""
        check_divides_dp("shard group", shard, self.dp)
        block = shard * self.cp  # data_groups order: dp index outer, cp inner
        shard_groups, replicate_groups = [], []
        for group in self.data_groups():
            shard_groups += [group[start: start + block] for start in range(0, len(group), block)]
            replicate_groups += [group[offset::block] for offset in range(block)]
        return shard_groups, replicate_groups

    def expert_data_groups(self) -> list[list[int]]:
        """The ranks holding the same experts over dp and cp: at each (pp, tp) position and ep index e, the
        dp indices e, e + ep, ... (the edp ranks) times every cp index, dp index outer. What an expert's
        gradient is summed over when cp > 1 (each cp rank routed its own part of the sequences)."""
        groups = []
        for pp, tp, e in product(range(self.pp), range(self.tp), range(self.ep)):
            groups.append([self.rank(pp=pp, dp=d, cp=c, tp=tp) for d in range(e, self.dp, self.ep)
                           for c in range(self.cp)])
        return groups

    def dp_split(self, shard: int) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replicate groups) of the dp axis cut into groups of `shard` consecutive dp ranks:
        hierarchical sharding (MiCS / HSDP: shard = dp_shard) or expert parallelism (shard = ep).

        The dp ranks of each (pp, tp) position are cut into dp / shard groups of `shard` consecutive
        dp indices: dp_index = replicate_index * shard + shard_index. A shard group holds one copy of
        the state, split `shard` ways; a replicate group links the ranks that hold the same shard.
        """
        check_divides_dp("shard group", shard, self.dp)
        shard_groups, replicate_groups = [], []
        for dp_group in self.all_groups("dp"):
            for start in range(0, self.dp, shard):
                shard_groups.append(dp_group[start: start + shard])
            for offset in range(shard):
                replicate_groups.append(dp_group[offset::shard])
        return shard_groups, replicate_groups

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.grid_size:
            where = " (a parameter server: it has no place on the grid)" if self.is_server(rank) else ""
            raise ValueError(f"rank {rank} out of range for the grid of {self.grid_size} ranks{where}")
