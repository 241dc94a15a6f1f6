"""estimate (one layout: memory per rank, step time) and search (every layout of a device count,
checked by paratrain's own rules, ranked by predicted step time)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Mapping

from paratrain.config.errors import ConfigError
from paratrain.config.layout import parallel_config
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig
from paratrain.config.plan import batch_layout
from paratrain.config.model_rules import (check_context_parallel, check_experts, check_grid_rows, check_pipeline,
                                      check_tensor_parallel)
from paratrain.planner.float8 import float8_speedup
from paratrain.planner.hardware import Hardware
from paratrain.planner.layout import Layout
from paratrain.planner.optimizer import muon_seconds
from paratrain.planner.peak import memory
from paratrain.planner.settings import PRICED, StepSettings
from paratrain.planner.timing import step_time


def check_layout(model: ModelConfig, layout: Layout, *, global_batch: int, seq: int) -> None:
    """paratrain's own rules for the layout (the messages `paratrain train` gives), or ConfigError."""
    check_fields(model, layout.to_dict(), global_batch=global_batch, seq=seq)


def check_fields(model: ModelConfig, fields: Mapping[str, Any], *, global_batch: int, seq: int) -> None:
    """check_layout on a layout's flat fields (Layout.to_dict's), before a Layout is built of them: the rules
    speak first, in `paratrain train`'s order."""
    parallel = parallel_config(fields).resolved(  # the run's own settings of this layout (paratrain.config.layout)
        fields["dp"] * fields["tp"] * fields["pp"] * fields["cp"] + fields["ps_servers"])
    if fields["recompute"] not in ("none", "full", "selective"):
        raise ConfigError(f"recompute must be 'none', 'full' or 'selective', got {fields['recompute']!r}")
    check_tensor_parallel(model, parallel, seq)
    check_context_parallel(model, parallel, seq)
    check_experts(model, parallel)
    batch = batch_layout(global_batch, fields["micro_batch"], fields["dp"])
    check_grid_rows(parallel, batch)
    check_pipeline(model, parallel, batch)


def _refusal(model: ModelConfig, fields: dict[str, Any], *, global_batch: int, seq: int,
             refusals: dict[tuple[Any, ...], str | None]) -> str | None:
    """check_fields' message for these fields (None: they pass), asked once for the layouts that differ only in
    recompute: the rules read every other field but that one, whose three values the search tries are all allowed."""
    if fields["recompute"] not in ("none", "full", "selective"):  # (a pinned value: check_fields says the rule)
        key: tuple[Any, ...] = tuple(fields.values())
    else:
        key = tuple(v for k, v in fields.items() if k != "recompute")
    if key not in refusals:
        try:
            check_fields(model, fields, global_batch=global_batch, seq=seq)
            refusals[key] = None
        except ConfigError as error:
            refusals[key] = str(error)
    return refusals[key]


@dataclasses.dataclass(frozen=True)
class Run:
    """What a candidate is priced for besides its layout and the hardware."""

    global_batch: int
    seq: int
    settings: StepSettings = PRICED
    """The engine's settings: precision, optimizer (Muon adds its Newton-Schulz and exchange:
    paratrain.planner.optimizer), gradient and state dtypes."""
    kernels: str = "eager"
    """How the blocks run (paratrain.planner.ops.KERNELS): eager, compiled, Megatron's fused."""
    exact: bool = True
    """Muon's exchange from its own plan per rank (else estimated: what the search ranks many layouts by)."""


def estimate(model_config: ModelConfig, layout: Layout, hardware: Hardware, *, global_batch: int,
             seq_len: int | None = None, kernels: str = "eager", settings: StepSettings = PRICED) -> dict[str, Any]:
    """The candidate record of one layout: its memory (worst rank, bytes) and predicted step time (kernels:
    eager or compiled blocks, paratrain.planner.ops.KERNELS)."""
    seq = seq_len or model_config.seq_len
    check_layout(model_config, layout, global_batch=global_batch, seq=seq)
    return _record(model_config, layout, hardware, Run(global_batch, seq, settings, kernels))


def _record(model_config: ModelConfig, layout: Layout, hardware: Hardware, run: Run) -> dict[str, Any]:
    """estimate's record of a layout already checked."""
    mem = memory(model_config, layout, global_batch=run.global_batch, seq=run.seq, settings=run.settings,
                 exact=run.exact)
    t = step_time(model_config, layout, hardware, global_batch=run.global_batch, seq=run.seq, settings=run.settings,
                  kernels=run.kernels)
    step, terms = t.step_s, t.terms
    if run.settings.optimizer == "muon":  # after the pipelined part, as the element-wise step
        muon = muon_seconds(model_config, layout, hardware, run.settings, exact=run.exact)
        step += sum(muon.values())
        terms = {**terms, "Muon: Newton-Schulz": muon["newton-schulz"], "Muon: exchange": muon["exchange"]}
    record = {"layout": layout.to_dict(), "memory": mem, "step_time_s": step, "compute_s": t.compute_s,
              "comm_s": t.comm_s, "bubble": t.bubble, "tokens_per_s": t.tokens_per_s * t.step_s / step,
              "mfu": t.mfu * t.step_s / step, "terms": terms, "fits": mem["peak"] <= hardware.memory_bytes}
    if run.settings.optimizer == "muon":
        record["muon_exchange"] = "exact" if run.exact else "estimated"
    return record


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelConfig, devices: int, hardware: Hardware, *, global_batch: int,
               pins: dict[str, Any] | None = None, seq: int | None = None) -> list[Layout]:
    """Every layout of `devices` ranks the search considers: tp within a node (any tp for the grid modes: 2d on a
    square tp, 2.5d on depth x a square, 3d on a cube; without sequence parallelism, cp or ep), cp dividing the
    sequence into 2 cp chunks of which each rank keeps at least CP_MIN_TOKENS tokens (ring, and Ulysses where the
    heads divide), pp up to the layers, 1 or 2 virtual stages, ZeRO 0-3 over all of dp, power-of-two micro-batches,
    no / selective / full recompute, sequence parallelism with tp, and for a MoE model every ep dividing both dp and
    the experts; `pins` fixes any field. Pins that make no layout at all (an ep that does not divide dp) are left
    out: `search` lists them as rejected. The parameter server is tried only when pinned (ps_mode, ps_servers,
    staleness): data parallelism alone over the devices its dedicated servers leave (on one fabric it moves what an
    all-reduce moves, later and through fewer links: it is chosen for asynchrony or sparse tables, not speed)."""
    out = []
    for fields in _candidate_fields(model, devices, hardware, global_batch=global_batch, pins=pins or {},
                                    seq=seq or model.seq_len):
        try:
            out.append(Layout.of(**fields))
        except ConfigError:
            continue
    return out


def _candidate_fields(model: ModelConfig, devices: int, hardware: Hardware, *, global_batch: int,
                      pins: dict[str, Any], seq: int, dropped: list[str] | None = None) -> list[dict[str, Any]]:
    """`candidates` as flat fields (Layout.of's), each once, in the search's order. dropped: gets the rule of the
    first grid left out before any layout of it is made (dp not dividing the global batch, pins that make another
    device count): `search` says it when no layout is made at all."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    dropped = [] if dropped is None else dropped

    def drop(reason: str) -> None:  # the first reason only: the loops below may leave out thousands of grids
        if not dropped:
            dropped.append(reason)
    served = pins.get("ps_mode", "off") != "off"
    servers = pins.get("ps_servers", 0)
    devices -= servers  # dedicated parameter servers train nothing: the grid is the trainers'
    if devices < 1:
        drop(f"{servers} dedicated parameter servers leave no trainer of the {devices + servers} devices: "
                       "lower --ps-servers or raise --gpus")
    axes = {axis: pins[axis] for axis in ("dp", "tp", "cp", "pp") if axis in pins}
    if devices >= 1 and devices % math.prod(axes.values()):
        drop(f"the pinned {' x '.join(f'{axis} {n}' for axis, n in axes.items())} make groups of "
                       f"{math.prod(axes.values())} ranks, which do not divide the {devices} "
                       f"{'trainers' if servers else 'devices'}: change the pins or --gpus")
    for tp, cp in itertools.product(_divisors(devices), _divisors(devices)):
        if served and tp * cp > 1:  # the parameter server composes with data parallelism only
            continue
        grids = grid_modes(tp) if cp == 1 and not model.n_experts and not served and (
            tp <= GRID_MAX_TP or pins.get("tp") == tp) else []
        if devices % (tp * cp) or (cp > 1 and seq % (2 * cp)):
            continue
        if tp > hardware.devices_per_node and not grids and pins.get("tp") != tp:  # 1d stays in a node
            continue
        if pins.get("tp_mode", "1d") != "1d" and tp > 1 and not grids and pins.get("tp") != tp:
            continue  # a pinned grid mode: the tp degrees that have its shape
        if cp > 1 and seq // cp < CP_MIN_TOKENS and pins.get("cp") != cp:
            continue
        heads = model.n_head // tp
        modes = [("ring", 1)] + ([("ulysses", 1)] if cp > 1 and heads % cp == 0 else []) + [
            ("usp", u) for u in range(2, cp) if cp % u == 0 and heads % u == 0]  # Ulysses inside, a ring across
        for pp in _divisors(devices // (tp * cp)):
            if pp > model.n_layer + 2 or (served and pp > 1):
                continue
            dp = devices // (tp * cp * pp)
            if global_batch % dp:
                if all(pins.get(axis, n) == n for axis, n in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp))):
                    drop(
                        f"the trainers' dp {dp} (the {devices + servers} devices less {servers} parameter servers) "
                        f"does not divide the global batch {global_batch}: change --global-batch, --gpus or "
                        "--ps-servers" if served and servers else
                        f"dp {dp} (the {devices} devices over tp {tp} x cp {cp} x pp {pp}) does not divide the global "
                        f"batch {global_batch}: change --global-batch or --gpus, or pin --tp, --cp or --pp")
                continue
            per_rank = global_batch // dp
            micro = [m for m in (1, 2, 4, 8, 16, 32) if per_rank % m == 0]
            eps = [e for e in _divisors(dp) if model.n_experts % e == 0] if model.n_experts and not served else [1]
            cuts = (False, True) if tp > 1 and model.n_experts else (False,)
            shapes = ([("1d", 1)] if tp <= hardware.devices_per_node or pins.get("tp") == tp else []) + grids
            if "tp_mode" in pins:  # a pinned mode (and depth): its shapes only, or itself to be refused with the rule
                pinned = [(m, d) for m, d in [("1d", 1), *grids] if m == pins["tp_mode"]
                          and d == pins.get("tp_depth", d)]
                shapes = pinned or [(pins["tp_mode"], pins.get("tp_depth", 1))]
            for (v, schedule), zero, mb, recompute, sp, ep, (mode, u), cut, (tp_mode, depth) in itertools.product(
                    PIPELINES if pp > 1 else ((1, "1f1b"),), (0,) if served else (0, 1, 2, 3), micro,
                    ("none", "selective", "full"), (False, True) if tp > 1 else (False,), eps, modes, cuts, shapes):
                v_fits = 2 * pp <= model.n_layer + 2
                if schedule == "zb-h1" and (per_rank // mb < pp or v_fits) and "schedule" not in pins:
                    continue  # ZB-H1 needs a micro-batch per stage at least (its rule, said when pinned); where ZB-V
                    # cuts the model, it idles half ZB-H1's at the same memory a rank, so only ZB-V is priced
                if schedule == "dualpipev" and (per_rank // mb < 2 * pp or pp < 8) and "schedule" not in pins:
                    continue  # its rule (said when pinned); below pp 8 it idles as ZB-V does, or one pass less at
                    # pp 2, and holds one chunk more: ZB-V is priced there
                if tp_mode != "1d" and (sp or ep > 1 or cut):  # the grid modes compose with none of these
                    continue
                if tp_mode != "1d" and "micro_batch" not in pins and mb % ParallelConfig(
                        tp=tp, tp_mode=tp_mode, tp_depth=depth).tp_row_parts:
                    continue  # the grid splits the micro-batch's rows
                fields = dict(_DEFAULTS, dp=dp, tp=tp, pp=pp, virtual_stages=v, zero=zero, micro_batch=mb,
                              recompute=recompute, sequence_parallel=sp,
                              schedule=schedule, ep=ep, cp=cp, cp_mode=mode, cp_ulysses=u, expert_tp=cut,
                              tp_mode=tp_mode, tp_depth=depth)
                if pins:
                    fields.update({k: pins[k] for k in pins if k in fields})
                    ranks = fields["dp"] * fields["tp"] * fields["pp"] * fields["cp"]
                    if ranks != devices:
                        drop(f"the pins make dp {fields['dp']} x tp {fields['tp']} x pp {fields['pp']} x cp "
                                       f"{fields['cp']} = {ranks} trainers, not the {devices} devices"
                                       + (f" less {servers} parameter servers" if servers else "")
                                       + ": change the pins or --gpus")
                        continue
                out.setdefault(tuple(fields.values()), fields)
    return list(out.values())


def grid_modes(tp: int) -> list[tuple[str, int]]:
    """The grid layouts of tp ranks the search tries, (tp_mode, tp_depth): 2d when tp is a square, 2.5d at depth 2
    or 4 leaving a square of at least 4 (pin --tp-depth for others), 3d when tp is a cube (of at least 8)."""
    modes: list[tuple[str, int]] = []
    if tp >= 4 and math.isqrt(tp) ** 2 == tp:
        modes.append(("2d", 1))
    modes += [("2.5d", d) for d in (2, 4) if tp % d == 0 and tp // d >= 4 and math.isqrt(tp // d) ** 2 == tp // d]
    q = round(tp ** (1 / 3))
    if tp >= 8 and q ** 3 == tp:
        modes.append(("3d", 1))
    return modes


PIPELINES = ((1, "1f1b"), (1, "zb-h1"), (2, "interleaved"), (2, "zb-v"), (2, "dualpipev"))
"""The (chunks a rank, schedule) pairs the search tries under pp > 1 (pin --schedule for the others: GPipe holds
every micro-batch, and zero-bubble trades ZB-H1's later stages' memory for more idle time); ZB-H1 only where the
model has too few layers for the V's 2 pp chunks, DualPipeV at pp 8 and up with 2 pp micro-batches or more."""

GRID_MAX_TP = 64
"""The search tries the grid modes up to this tp (pin --tp to try more): the largest grids of the papers (Optimus,
Tesseract, 3D: 64 GPUs), and where each micro-batch still holds rows for every block (an assumption of the search,
not a rule of the engine)."""

CP_MIN_TOKENS = 1024
"""The search tries a cp degree only where each rank keeps at least this many tokens of a sequence (pin cp to
try any): context parallelism is for sequences whose activations do not fit, and below this its exchange per
token costs more than it saves (an assumption of the search, not a rule of the engine)."""

EXACT = 16
"""Under Muon, the fastest fitting layouts the search prices again from the exchange's own plan."""

_DEFAULTS = Layout().to_dict()
"""A layout's flat fields at their defaults, in to_dict's order."""


def search(model_config: ModelConfig, devices: int, hardware: Hardware, *, global_batch: int,
           seq_len: int | None = None, pins: dict[str, Any] | None = None, kernels: str = "eager",
           settings: StepSettings = PRICED) -> dict[str, list[dict[str, Any]]]:
    """{"candidates": fitting layouts, fastest first, then those that do not fit, smallest peak first;
    "rejected": [{"layout", "reason"}] for layouts paratrain's rules refuse; and, only when no layout is made at all,
    "unmade": the first rule that left a grid out (dp not dividing the global batch, pins of another device count)}.
    Under Muon every layout is priced with its exchange estimated, then the EXACT fastest fitting ones again from the
    exchange's own plan (about a second each on a thousand ranks) and ranked again: the table's first rows and
    `--plan auto`'s choice are priced exactly (their records say "muon_exchange": "exact")."""
    if seq_len and seq_len > model_config.seq_len:  # the model is built for sequences this long
        model_config = dataclasses.replace(model_config, seq_len=seq_len)
    seq = seq_len or model_config.seq_len
    if settings.precision == "fp8":  # said once, not for every layout
        float8_speedup(hardware.name, hardware.float8_speedup)
    fits, too_big, rejected = [], [], []
    muon = settings.optimizer == "muon"
    run = Run(global_batch, seq, settings, kernels, exact=not muon)
    refusals: dict[tuple[Any, ...], str | None] = {}  # the rules' answer, by the fields they read
    dropped: list[str] = []
    made = _candidate_fields(model_config, devices, hardware, global_batch=global_batch, pins=pins or {}, seq=seq,
                             dropped=dropped)
    for fields in made:
        reason = _refusal(model_config, fields, global_batch=global_batch, seq=seq, refusals=refusals)
        if reason is None:
            try:
                record = _record(model_config, Layout.of(**fields), hardware, run)
            except ConfigError as error:
                reason = str(error)
        if reason is not None:
            rejected.append({"layout": fields, "reason": reason})
            continue
        (fits if record["fits"] else too_big).append(record)
    fits.sort(key=lambda r: r["step_time_s"])
    if muon:  # the first ones again, from the exchange's own plan
        exact_run = dataclasses.replace(run, exact=True)
        again = [_record(model_config, Layout.of(**r["layout"]), hardware, exact_run) for r in fits[:EXACT]]
        fits = sorted([r for r in again if r["fits"]], key=lambda r: r["step_time_s"]) + fits[EXACT:]
        too_big += [r for r in again if not r["fits"]]
    too_big.sort(key=lambda r: r["memory"]["peak"])
    result: dict[str, Any] = {"candidates": fits + too_big, "rejected": rejected}
    if not made:
        result["unmade"] = dropped[0] if dropped else "the search space holds no layout of these devices"
    return result
