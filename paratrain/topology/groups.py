"""RankGroups: which ranks form each group of every axis, as ParallelDims lays the (pp, dp, cp, tp) grid out (its
base: the degrees and a rank's place are dims.py's, the groups this file's). Every rank computes the same lists in
the same order, which is what paratrain.topology.mesh needs to call new_group alike everywhere. Pure Python."""

from __future__ import annotations

from itertools import product

from paratrain.config.rules import check_divides_dp

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""The axes of the rank grid, outermost first."""


class RankGroups:
    """The groups of ParallelDims' axes (its base class: every method reads the dims' degrees and rank order)."""

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
