"""Hardware profiles: what the time and memory models need to know of a device and its links.

Data-sheet figures (dense 16-bit tensor-core peak, memory, link bandwidth per GPU) and the rates the
per-operation step time prices a step with (paratrain.planner.ops: a GEMM table by arithmetic intensity,
attention, achieved memory bandwidth, launch time), fitted to measured or published steps for the shipped
GPU profiles (paratrain.planner.fit); or, without those rates, one efficiency that turns the peak into what a
step reaches (the CPU profile, with its fixed overhead per block). Bandwidths are *bus* bandwidths as
NCCL-tests define them (an all-reduce of n bytes takes 2 (k - 1) / k x n / bw on k ranks), per GPU, one
direction. Every field can be overridden (`paratrain plan --peak-tflops ...`); `cpu` is measured on this
machine by `paratrain plan --calibrate` (paratrain.planner.calibrate), which saves it where `--hardware cpu`
reads it (CPU_PROFILE); on a CUDA machine it measures the GPU's rates (paratrain.planner.calibrate_device)
for `--hardware gpu` (GPU_PROFILE).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from paratrain.config.errors import ConfigError

GIB = 2**30
CPU_PROFILE = Path.home() / ".cache" / "paratrain" / "cpu.json"
"""Where `paratrain plan --calibrate` saves this machine's profile and `--hardware cpu` reads it."""
GPU_PROFILE = Path.home() / ".cache" / "paratrain" / "gpu.json"
"""Where `paratrain plan --calibrate` on a CUDA machine saves its GPU's profile and `--hardware gpu` reads it."""


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense 16-bit matmul FLOP/s per device (fp32 on a CPU)."""
    memory_bytes: float
    """Memory per device a run may use."""
    intra_node_bw: float
    """Bus bandwidth, bytes/s per device, between devices of one node (NVLink; shared memory on a CPU)."""
    inter_node_bw: float
    """Bus bandwidth, bytes/s per device, between nodes (the network)."""
    devices_per_node: int = 8
    efficiency: float = 0.5
    """Without per-operation rates: the share of the peak a step's FLOPs reach (an MFU; the measured CPU
    profile's). With them (`per_operation`) it still prices a MoE model's compute (the first-order model) and the
    8 T P / (n X) estimate."""
    latency_s: float = 10e-6
    """Fixed cost of one collective or point-to-point message."""
    overhead_s: float = 0.0
    """Fixed time per transformer block and micro-batch (forward and backward) that FLOPs do not
    count: operator launches and Python. Measured by --calibrate on a CPU; 0 (not modelled) in the
    GPU profiles."""
    moe_overhead_s: float = 0.0
    """A MoE layer's fixed time per micro-batch beyond a dense block's (router, top-k, the sort by expert, one
    launch per expert). Measured by --calibrate on a CPU; 0 in the GPU profiles."""
    memory_bw: float = 0.0
    """Achieved device-memory bandwidth, bytes/s: the rate of memory-bound operations. With `gemm` it turns on
    the per-operation model (paratrain.planner.ops); 0: step time is FLOPs at peak x efficiency + overhead_s."""
    gemm: tuple[tuple[float, float, float, float], ...] = ()
    """Matmul efficiency by shape: rows (arithmetic intensity 1 / (1/m + 1/n + 1/k); share of peak forward, data
    gradient, weight gradient), ascending (paratrain.planner.ops.gemm_efficiency)."""
    attention_efficiency: float = 0.0
    """Share of peak the fused attention kernel reaches on its FLOPs."""
    launch_s: float = 0.0
    """Device time lost per kernel launched (eager launches one by one; compiled blocks launch fewer)."""
    float8_speedup: float = 1.0
    """Float8 matmuls' rate over the 16-bit peak (precision fp8: paratrain.planner.float8): 2 on an H100 or H200
    (1,979 over 989 dense TFLOP/s, the data sheets'), 0 on an A100 (none: fp8 is refused), 1 on a CPU (torch
    emulates them; not measured)."""
    overlap_loss: float = 0.0
    """The share of an overlap lost: while a data-parallel collective runs under compute, that much of the
    overlapped time is still paid (compute slowed by the collective's SMs and memory traffic, a prefetch pipeline's
    waits). 0: perfect overlap (the CPU profile, which has not measured it)."""

    @property
    def per_operation(self) -> bool:
        """Whether step time is priced by operation (paratrain.planner.ops) rather than one efficiency."""
        return self.memory_bw > 0 and bool(self.gemm)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def bandwidth(self, span: int) -> float:
        """The link of a group whose ranks lie within `span` consecutive ranks: inside a node when span fits in one."""
        return self.intra_node_bw if span <= self.devices_per_node else self.inter_node_bw

    def bus_time(self, nbytes: float, ranks: int, span: int, *, factor: float) -> float:
        """Seconds of a collective of `nbytes` over `ranks` ranks lying within `span` consecutive ranks: latency +
        factor x (k - 1) / k x bytes / bandwidth (factor 2 for an all-reduce, 1 for a reduce-scatter or all-gather)."""
        return bus_time(nbytes, ranks, self.bandwidth(span), self.latency_s, factor=factor)


def bus_time(nbytes: float, ranks: int, bw: float, latency: float, *, factor: float) -> float:
    """factor x (k - 1) / k x bytes / bw after the latency: 2 for an all-reduce, 1 for reduce-scatter or all-gather;
    0 for a group of one."""
    if ranks <= 1:
        return 0.0
    return latency + factor * (ranks - 1) / ranks * nbytes / bw


def roofline_table(peak: float, memory_bw: float, best: float, dims: tuple[int, ...] = (
        128, 256, 512, 1024, 2048, 4096, 8192, 16384), tokens: int = 16384) -> tuple[tuple[float, ...], ...]:
    """A GEMM table (Hardware.gemm) where none was measured: [tokens, d] x [d, d] products, each at
    1 / (1 / best + peak / (intensity x bandwidth)) of peak (a roofline whose loads are not hidden), the
    same for the three kinds."""
    rows = []
    for d in dims:
        intensity = 1.0 / (1.0 / tokens + 2.0 / d)
        eff = 1.0 / (1.0 / best + peak / (intensity * memory_bw))
        rows.append((intensity, eff, eff, eff))
    return tuple(rows)


def with_rates(base: Hardware, *, best: float, attention: float, bandwidth: float, launch_s: float,
               datasheet_bw: float, overlap_loss: float = 0.0) -> Hardware:
    """`base` priced by operation (paratrain.planner.ops): memory at `bandwidth` x the data sheet's, the
    roofline table up to `best`, attention at `attention` of peak, launch_s per kernel."""
    bw = datasheet_bw * bandwidth
    return replace(base, memory_bw=bw, gemm=roofline_table(base.peak_flops, bw, best), attention_efficiency=attention,
                   launch_s=launch_s, overlap_loss=overlap_loss)


# NVIDIA data sheets: A100 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s both ways (300 one way), HDR
# 200 Gb/s per GPU, HBM2e 2.04 TB/s (80 GB; 1.56 for 40 GB); H100 SXM 989 TFLOP/s, NVLink 4 900 GB/s (450 one
# way), NDR 400 Gb/s per GPU, HBM3 3.35 TB/s; H200 as H100 with 141 GB of HBM3e at 4.8 TB/s. Achieved bus
# bandwidths are below the link's: 0.75 of it is taken here.
DATASHEET_MEMORY_BW = {"a100-40gb": 1.555e12, "a100-80gb": 2.039e12, "h100-80gb": 3.35e12, "h200": 4.8e12}
"""Device-memory bandwidth of the data sheets, bytes/s."""
DATASHEETS: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 312e12, 40 * GIB, 0.75 * 300e9, 0.75 * 25e9, float8_speedup=0.0),
    "a100-80gb": Hardware("a100-80gb", 312e12, 80 * GIB, 0.75 * 300e9, 0.75 * 25e9, float8_speedup=0.0),
    "h100-80gb": Hardware("h100-80gb", 989e12, 80 * GIB, 0.75 * 450e9, 0.75 * 50e9, float8_speedup=2.0),
    "h200": Hardware("h200", 989e12, 141e9, 0.75 * 450e9, 0.75 * 50e9, float8_speedup=2.0),
}
"""The data sheets alone: one efficiency for every FLOP (what paratrain.planner.fit starts from)."""
FITTED_RATES = {
    # python -m paratrain.planner.fit bench/results/h100-gpt2-*.json bench/results/h100-gpt3xl-*.json: the
    # repo's one-H100 runs (gpt2, gpt3-xl; eager and compiled; no, selective and full recomputation)
    "h100-80gb": dict(best=0.95, attention=0.42, bandwidth=0.7204, launch_s=1.7408e-5),
    # python -m paratrain.planner.fit --published: Korthikanti et al. 2022, Table 5 (Megatron-LM on 80 GB A100s,
    # paratrain.planner.published)
    "a100-80gb": dict(best=0.8716, attention=0.2, bandwidth=0.6, launch_s=2e-5),
}
# overlap_loss: fitted to Narayanan et al. 2021, Table 2's ZeRO-3 rows (paratrain.planner.fit.fit_overlap), the
# published runs whose step hangs on a collective under compute; charged on every overlapped dp collective of every
# GPU layout; the H100 borrows it (not measured there)
OVERLAP_LOSS = 0.45
FITTED_RATES["h200"] = FITTED_RATES["h100-80gb"]  # not measured: the H100's rates, the H200's bandwidth
FITTED_RATES["a100-40gb"] = FITTED_RATES["a100-80gb"]
PROFILES: dict[str, Hardware] = {name: with_rates(sheet, **FITTED_RATES[name], datasheet_bw=DATASHEET_MEMORY_BW[name],
                                                  overlap_loss=OVERLAP_LOSS) for name, sheet in DATASHEETS.items()}
"""The shipped GPU profiles, priced by operation with the rates fitted to measured or published steps."""


def _gemm_rows(rows: object, source: str) -> tuple[tuple[float, float, float, float], ...]:
    """A profile file's GEMM table, checked: rows of (intensity, forward, data-gradient, weight-gradient share of
    peak), intensities ascending, shares in (0, 1]."""
    try:
        table = tuple((float(r[0]), float(r[1]), float(r[2]), float(r[3])) for r in rows)  # type: ignore[union-attr]
        ok = all(len(r) == 4 for r in rows)  # type: ignore[union-attr]
    except (TypeError, ValueError, IndexError):
        table, ok = (), False
    keys = [r[0] for r in table]
    if not ok or keys != sorted(keys) or any(not 0 < e <= 1 for r in table for e in r[1:]):
        raise ConfigError(f"hardware profile {source!r}: gemm must be rows [intensity, forward, data gradient, weight "
                          f"gradient] with intensities ascending and shares of peak in (0, 1], got {rows!r}; "
                          "re-measure it with `paratrain plan --calibrate` on the GPU")
    return table


def hardware(name_or_path: str, **overrides: float) -> Hardware:
    """A profile by name, or from a JSON file (what --calibrate saves), with fields overridden (an efficiency
    prices every FLOP at it: the per-operation tables are dropped)."""
    saved = {"cpu": CPU_PROFILE, "gpu": GPU_PROFILE}
    if name_or_path in saved and not saved[name_or_path].exists():
        raise ConfigError(f"no {name_or_path.upper()} profile at {saved[name_or_path]}: measure this machine first with "
                          f"`paratrain plan --calibrate`{' on a CUDA machine' if name_or_path == 'gpu' else ''} "
                          "(under a minute)")
    if name_or_path in PROFILES:
        profile = PROFILES[name_or_path]
    elif name_or_path in saved or name_or_path.endswith(".json"):
        path = saved.get(name_or_path, Path(name_or_path))
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"hardware profile {name_or_path!r} cannot be read: {error}") from None
        known = {f.name for f in fields(Hardware)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"hardware profile {name_or_path!r} has unknown fields {unknown}: it may hold {sorted(known)}")
        data["gemm"] = _gemm_rows(data.get("gemm") or (), name_or_path)
        profile = Hardware(**data)
    else:
        raise ConfigError(f"unknown hardware {name_or_path!r}: choose one of {', '.join(PROFILES)}, cpu or gpu (after "
                          "`paratrain plan --calibrate`), or a profile file written by `paratrain plan --calibrate "
                          "--save-hardware FILE.json`")
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        if not value > 0:
            raise ConfigError(f"hardware {key} must be > 0, got {value}")
    loss = given.get("overlap_loss", profile.overlap_loss)
    if not 0 <= loss <= 1:
        raise ConfigError(f"hardware overlap_loss must be in [0, 1] (the share of a collective's overlap with compute "
                          f"still paid), got {loss}")
    if "efficiency" in given:  # one efficiency for every FLOP: the per-operation model off
        given["gemm"] = ()
    return replace(profile, **given) if given else profile
