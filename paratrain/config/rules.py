"""Rules of ParallelConfig.resolved that each concern one strategy: how tp splits each layer, and the parameter
server (kept apart so that the config's own file stays the layout's fields and their arithmetic)."""

from __future__ import annotations

import math
from typing import Protocol

from paratrain.config.errors import ConfigError


class LayoutFields(Protocol):
    """What these rules read of a layout (ParallelConfig has it; this file does not import it, which imports
    this file)."""

    dp: int | None
    tp: int
    tp_mode: str
    tp_depth: int
    pp: int
    cp: int
    ep: int
    zero: int
    expert_tp: bool
    sequence_parallel: bool
    shard_group: int | None
    offload: str
    ps_mode: str
    ps_servers: int
    staleness: int
    ps_sparse: tuple[str, ...]
    dp_mode: str
    fault_tolerance: str
    replica_groups: int
    inner_steps: int
    outer_lr: float
    outer_momentum: float
    outer_fragments: int

def grid_dp(config: LayoutFields, trainers: int) -> int:
    """The grid's rule: dp x tp x pp x cp = the trainers (the world less the dedicated parameter servers); dp, or
    the dp it leaves when dp is None. The one home of the product: ParallelConfig.resolved applies it, and through it
    the CLI, the Trainer and the planner's search."""
    model_parallel = config.tp * config.pp * config.cp
    axes = ("tp", "pp", "cp") if config.cp > 1 else ("tp", "pp")  # cp named where it is used
    names, values = " x ".join(axes), " x ".join(str(getattr(config, a)) for a in axes)
    if trainers % model_parallel:
        raise ConfigError(f"{names} = {values} = {model_parallel} must divide the world size ({trainers}): change "
                          f"{'/'.join(axes)} or the number of processes")
    dp = config.dp if config.dp is not None else trainers // model_parallel
    if dp < 1:
        raise ConfigError(f"dp must be >= 1, got {dp}")
    if dp * model_parallel != trainers:
        raise ConfigError(f"dp x {names} = {dp} x {values} = {dp * model_parallel} must equal the world size "
                          f"({trainers}): set dp={trainers // model_parallel} or run {dp * model_parallel} processes "
                          "(--nproc)")
    return dp


TP_MODES = ("1d", "2d", "2.5d", "3d")
"""How tensor parallelism splits each layer (ParallelConfig.tp_mode)."""

DP_MODES: tuple[str, ...] = ("sync", "diloco")
"""How the data-parallel ranks stay together (ParallelConfig.dp_mode): every step, or DiLoCo's outer steps."""

PS_MODES: tuple[str, ...] = ("off", "sync", "async")
"""The parameter server (ParallelConfig.ps_mode): off (collective data parallelism), synchronous, or
asynchronous with bounded staleness (paratrain.param_server)."""


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt n) (a flag may say 10**9: listing them must not take
    a minute)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_divides_dp(name: str, value: int, dp: int, why: str = "") -> None:
    """A sub-axis of dp (ep, a ZeRO shard group) divides dp, or a ConfigError naming the values that do."""
    if value < 1 or dp % value:
        choices = divisors(dp)
        raise ConfigError(f"{name} ({value}) must divide dp ({dp}){why}; choose {name} in {choices}")


def check_expert_parallel(ep: int, dp: int) -> None:
    """ep divides dp: experts are divided among ep consecutive dp ranks (ParallelConfig, ParallelDims)."""
    check_divides_dp("ep", ep, dp, ": expert parallelism divides the experts among dp ranks")


def check_shard_group(shard_group: int | None, zero: int, dp: int) -> None:
    """A ZeRO shard group (MiCS / HSDP) needs a ZeRO stage and divides dp (ParallelConfig, the planner's Layout,
    ParallelDims)."""
    if shard_group is None:
        return
    if not zero:
        raise ConfigError(f"shard_group={shard_group} needs a ZeRO stage: with zero=0 nothing is sharded; "
                          "set zero to 1 or 2, or drop shard_group")
    check_divides_dp("shard_group", shard_group, dp, ": each group of that many dp ranks holds one copy of the state")


def grid_side(tp_mode: str, tp: int, tp_depth: int) -> int:
    """q of a 2d / 2.5d tensor-parallel grid (tp_depth x q x q = tp ranks) or of a 3d cube (q^3 = tp); 1 under 1d
    (ParallelConfig.tp_split and ParallelDims.grid_side read it)."""
    if tp_mode == "3d":
        return round(tp ** (1 / 3))
    return math.isqrt(tp // max(tp_depth, 1)) if tp_mode in ("2d", "2.5d") else 1


def check_grid_shape(tp_mode: str, tp: int, tp_depth: int) -> None:
    """A grid mode's tp ranks fill its shape: a cube of at least 8 (3d), tp_depth squares of at least 4 (2d, 2.5d)."""
    q = grid_side(tp_mode, tp, tp_depth)
    if tp_mode == "3d" and (q < 2 or q ** 3 != tp):
        raise ConfigError(f"tp_mode 3d lays the tp ranks out as a q x q x q cube, so tp must be a cube of at "
                          f"least 8, got tp {tp}: choose tp in 8, 27, 64, or tp_mode 1d / 2d")
    if tp_mode in ("2d", "2.5d") and (q < 2 or tp_depth * q * q != tp):
        shape = "a q x q grid" if tp_depth == 1 else f"tp_depth ({tp_depth}) q x q grids"
        choices = ", ".join(str(tp_depth * n * n) for n in range(2, 7))
        raise ConfigError(f"tp_mode {tp_mode} lays the tp ranks out as {shape}, so tp must be "
                          f"{'' if tp_depth == 1 else f'{tp_depth} x '}a square of at least 4, got tp {tp}: "
                          f"choose tp in {choices}, or tp_mode 1d")


def check_usp(cp: int, cp_mode: str, cp_ulysses: int) -> None:
    """USP nests Ulysses in a ring: cp_ulysses consecutive cp ranks exchange heads, cp / cp_ulysses groups pass
    blocks round a ring (ParallelConfig, ParallelDims, the planner's Layout). Only cp_mode 'usp' has the degree."""
    if cp_mode != "usp":
        if cp_ulysses != 1:
            raise ConfigError(f"cp_ulysses ({cp_ulysses}) is the Ulysses degree inside cp_mode usp, and cp_mode is "
                              f"{cp_mode!r}: set cp_mode usp, or drop cp_ulysses")
        return
    inner = [u for u in range(2, cp) if cp % u == 0]
    if not inner:
        raise ConfigError(f"cp_mode usp splits cp ({cp}) into a Ulysses degree and a ring degree, each at least 2, "
                          f"so cp must be a product of two such (4, 6, 8, ...): use cp_mode ring or ulysses at cp {cp}")
    if cp_ulysses not in inner:
        raise ConfigError(f"cp_mode usp runs Ulysses over cp_ulysses consecutive cp ranks and a ring over cp / "
                          f"cp_ulysses of those groups, both at least 2: cp_ulysses ({cp_ulysses}) must divide cp "
                          f"({cp}) and lie between them; choose cp_ulysses in {inner}")


def check_tp_mode(config: LayoutFields) -> None:
    """How tp splits each layer (tp_mode, tp_depth), and what the grid modes compose with."""
    if config.tp_mode not in TP_MODES:
        raise ConfigError(f"tp_mode must be one of {', '.join(TP_MODES)}, got {config.tp_mode!r}")
    if config.tp_depth < 1 or (config.tp_depth > 1 and config.tp_mode != "2.5d"):
        raise ConfigError(f"tp_depth ({config.tp_depth}) stacks the grids of tp_mode 2.5d, and tp_mode is "
                          f"{config.tp_mode!r}: set tp_mode 2.5d, or drop tp_depth")
    if config.tp_mode == "1d":
        return
    check_grid_shape(config.tp_mode, config.tp, config.tp_depth)
    others = {"sequence_parallel": config.sequence_parallel, "cp": config.cp > 1,
              "expert_tp": config.expert_tp, "ep": config.ep > 1, "ps_mode": config.ps_mode != "off"}
    given = [name for name, on in others.items() if on]
    if given:
        raise ConfigError(f"tp_mode {config.tp_mode} with {', '.join(given)}: the grid splits every activation over its rows "
                          "(batch) and columns (hidden), which this version composes with data parallelism, ZeRO "
                          "1-3 and pipeline stages (sequence parallelism is 1d's way to split activations); drop "
                          f"{', '.join(given)}, or use tp_mode 1d")


def check_parameter_server(config: LayoutFields, world_size: int) -> None:
    """The parameter server holds whole slices of flat buckets of every parameter: it replaces data
    parallelism's collectives and ZeRO, and does not compose with what splits parameters otherwise."""
    if config.ps_mode not in PS_MODES:
        raise ConfigError(f"ps_mode must be one of {', '.join(PS_MODES)}, got {config.ps_mode!r}")
    if config.ps_servers < 0 or config.staleness < 0:
        raise ConfigError(f"ps_servers ({config.ps_servers}) and staleness ({config.staleness}) must be >= 0")
    if config.ps_mode == "off":
        if config.ps_sparse:
            raise ConfigError(f"ps_sparse ({', '.join(config.ps_sparse)}) names tables the parameter server sends "
                              "row by row, and ps_mode is 'off': set ps_mode to 'sync' or 'async'")
        if config.ps_servers or config.staleness:
            raise ConfigError(f"ps_servers ({config.ps_servers}) and staleness ({config.staleness}) configure the "
                              "parameter server, and ps_mode is 'off': set ps_mode to 'sync' or 'async'")
        return
    other = {"tp": config.tp, "pp": config.pp, "cp": config.cp, "ep": config.ep, "zero": config.zero}
    given = {k: v for k, v in other.items() if (v > 1 if k != "zero" else v > 0)}
    if given or config.shard_group is not None or config.offload != "none":
        names = ", ".join(f"{k}={v}" for k, v in given.items()) or (
            "shard_group" if config.shard_group is not None else f"offload={config.offload}")
        raise ConfigError(f"ps_mode {config.ps_mode!r} with {names}: the parameter server holds whole slices of "
                          "every parameter's flat bucket with their optimizer state (it is the sharding), and "
                          "it composes with data parallelism only in this version: drop them, or set ps_mode "
                          "to 'off'")
    if config.ps_mode == "async" and config.ps_servers == 0:
        raise ConfigError("ps_mode 'async' needs dedicated servers (ps_servers >= 1): a colocated server would "
                          "have to answer other trainers' pushes in the middle of its own step; use ps_mode "
                          "'sync' with ps_servers 0, or give ps_servers")
    if config.ps_mode == "sync" and config.staleness:
        raise ConfigError(f"staleness ({config.staleness}) bounds the asynchronous mode; ps_mode 'sync' has none: "
                          "set ps_mode to 'async' or drop staleness")
    if world_size - config.ps_servers < 1:
        raise ConfigError(f"ps_servers ({config.ps_servers}) leaves no trainer among {world_size} processes: run "
                          f"more processes (--nproc trainers + {config.ps_servers} servers)")


def check_diloco(config: LayoutFields, dp: int) -> None:
    """DiLoCo (dp_mode 'diloco'): replica groups of consecutive dp ranks, each training alone for inner_steps
    steps between outer steps. What this version composes it with: tp, pp, cp and ZeRO inside each group."""
    if config.dp_mode not in DP_MODES:
        raise ConfigError(f"dp_mode must be one of {', '.join(DP_MODES)}, got {config.dp_mode!r}")
    if config.dp_mode == "sync":
        if (config.replica_groups != 1 and config.fault_tolerance == "off") or config.inner_steps != 1 \
                or config.outer_fragments != 1:
            raise ConfigError(f"replica_groups ({config.replica_groups}), inner_steps ({config.inner_steps}) and "
                              f"outer_fragments ({config.outer_fragments}) configure DiLoCo, and dp_mode is 'sync': set "
                              "dp_mode 'diloco', or drop them")
        return
    groups = divisors(dp)[1:]
    if config.replica_groups not in groups:
        raise ConfigError(f"dp_mode diloco cuts dp ({dp}) into replica_groups groups of consecutive dp ranks, at "
                          f"least 2: replica_groups ({config.replica_groups}) must divide dp and be >= 2; "
                          + (f"choose replica_groups in {groups}" if groups else "run dp >= 2 (--nproc)"))
    if config.inner_steps < 1:
        raise ConfigError(f"DiLoCo's inner_steps ({config.inner_steps}) is the steps each replica group takes between outer "
                          "steps: it must be >= 1 (1 averages the groups' updates after every step)")
    if config.outer_fragments < 1 or config.inner_steps % config.outer_fragments:
        choices = divisors(config.inner_steps)
        raise ConfigError(f"Streaming DiLoCo staggers outer_fragments ({config.outer_fragments}) fragments evenly over "
                          f"the inner_steps ({config.inner_steps}) between outer steps: it must divide them; choose "
                          f"outer_fragments in {choices}")
    if not config.outer_lr > 0 or not 0 <= config.outer_momentum < 1:
        raise ConfigError(f"DiLoCo's outer step needs outer_lr > 0 (got {config.outer_lr}) and 0 <= "
                          f"outer_momentum < 1 (got {config.outer_momentum}); the paper's are 0.7 and 0.9")
    inside = dp // config.replica_groups
    if config.shard_group is not None and config.shard_group != inside:
        raise ConfigError(f"dp_mode diloco shards ZeRO's state inside each replica group of dp / replica_groups = "
                          f"{inside} ranks (the groups' weights differ between outer steps): shard_group "
                          f"({config.shard_group}) must be {inside}, or left out")
    given = [name for name, on in (("ep", config.ep > 1), ("ps_mode", config.ps_mode != "off")) if on]
    if given:
        raise ConfigError(f"dp_mode diloco with {', '.join(given)}: not built in this version (experts under ep "
                          "and the parameter server reduce over all of dp); DiLoCo composes with tp, pp, cp and "
                          f"ZeRO inside each replica group: drop {', '.join(given)}, or use dp_mode sync")


def check_diloco_uses(*, plan_auto: bool = False, muon: bool = False, spike: bool = False,
                      expert_bias: bool = False) -> None:
    """What a DiLoCo run does not do in this version, by name (the CLI's checks and paratrain.Trainer's)."""
    given = [what for what, on in (
        ("--plan auto (the planner's search prices synchronous data parallelism)", plan_auto),
        ("Muon (its matrices' owners span every rank, and the groups train apart)", muon),
        ("--spike-policy (it undoes a step by loading the state, or skips on one group's loss)", spike),
        ("--expert-bias / --global-aux-coef (each group would move its routers' state on its own counts)",
         expert_bias),
    ) if on]
    if given:
        raise ConfigError("dp_mode diloco with " + "; ".join(given) + ": not built in this version; drop them, or "
                          "use dp_mode sync")


FAULT_TOLERANCE: tuple[str, ...] = ("off", "replica")
"""ParallelConfig.fault_tolerance: one world, or replica groups that survive each other (paratrain.topology.quorum)."""


def check_fault_tolerance(config: LayoutFields, dp: int) -> None:
    """Replica groups (fault_tolerance 'replica'): dp cut into groups of consecutive ranks, each a job of its own,
    summing gradients over the live groups each step. What this version composes it with: tp, pp, cp and ZeRO
    inside a group."""
    if config.fault_tolerance not in FAULT_TOLERANCE:
        raise ConfigError(f"fault_tolerance must be one of {', '.join(FAULT_TOLERANCE)}, got {config.fault_tolerance!r}")
    if config.fault_tolerance == "off":
        return
    groups = divisors(dp)[1:]
    if config.replica_groups not in groups:
        raise ConfigError(f"fault_tolerance replica cuts dp ({dp}) into replica_groups groups of consecutive dp ranks "
                          f"that survive each other, at least 2: replica_groups ({config.replica_groups}) must divide "
                          "dp and be >= 2; " + (f"choose replica_groups in {groups}" if groups else "run dp >= 2"))
    inside = dp // config.replica_groups
    if config.shard_group is not None and config.shard_group != inside:
        raise ConfigError(f"fault_tolerance replica shards ZeRO's state inside each replica group of dp / "
                          f"replica_groups = {inside} ranks (a group's loss must not take another's shards with it): "
                          f"shard_group ({config.shard_group}) must be {inside}, or left out")
    if config.ep > 1 and inside % config.ep:
        raise ConfigError(f"fault_tolerance replica keeps each replica group's experts inside it: ep ({config.ep}) "
                          f"must divide the group's dp / replica_groups = {inside} ranks; choose ep in "
                          f"{divisors(inside)}")
    given = [name for name, on in (("ps_mode", config.ps_mode != "off"),
                                   ("dp_mode diloco with outer_fragments > 1 (Streaming DiLoCo)",
                                    config.dp_mode == "diloco" and config.outer_fragments > 1)) if on]
    if given:
        raise ConfigError(f"fault_tolerance replica with {', '.join(given)}: not built in this version; replica groups "
                          f"compose with tp, pp, cp and ZeRO inside each group, and with DiLoCo's outer step: "
                          f"drop {', '.join(given)}")
