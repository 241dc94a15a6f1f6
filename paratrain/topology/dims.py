"""ParallelDims: the layout of ranks on the (pp, dp, tp) grid. Pure Python, no torch.distributed.

Rank order puts tp innermost, then dp, then pp (as Megatron-LM): the ranks of one tp group are
adjacent, so on a multi-GPU node they share the fastest links.

    rank = (pp_index * dp + dp_index) * tp + tp_index
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from paratrain.config.errors import ConfigError
from paratrain.config.parallel import ParallelConfig

AXES: tuple[str, ...] = ("pp", "dp", "tp")  # outermost first


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ConfigError(f"degree of {axis} must be >= 1, got {getattr(self, axis)}")

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        resolved = config.resolved(world_size)
        assert resolved.dp is not None
        return cls(dp=resolved.dp, tp=resolved.tp, pp=resolved.pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def degree(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}: choose one of {AXES}")
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp': i, 'dp': j, 'tp': k} of a global rank."""
        self._check_rank(rank)
        tp_index = rank % self.tp
        dp_index = (rank // self.tp) % self.dp
        pp_index = rank // (self.tp * self.dp)
        return {"pp": pp_index, "dp": dp_index, "tp": tp_index}

    def rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        for axis, index in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= index < self.degree(axis):
                raise ValueError(f"{axis} index {index} out of range 0..{self.degree(axis) - 1}")
        return (pp * self.dp + dp) * self.tp + tp

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

    def dp_split(self, shard: int) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replicate groups) for hierarchical sharding (MiCS / HSDP) of the dp axis.

        The dp ranks of each (pp, tp) position are cut into dp / shard groups of `shard` consecutive
        dp indices: dp_index = replicate_index * shard + shard_index. A shard group holds one copy of
        the state, split `shard` ways; a replicate group links the ranks that hold the same shard.
        """
        if shard < 1 or self.dp % shard:
            raise ConfigError(f"shard group ({shard}) must divide dp ({self.dp})")
        shard_groups, replicate_groups = [], []
        for dp_group in self.all_groups("dp"):
            for start in range(0, self.dp, shard):
                shard_groups.append(dp_group[start: start + shard])
            for offset in range(shard):
                replicate_groups.append(dp_group[offset::shard])
        return shard_groups, replicate_groups

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
