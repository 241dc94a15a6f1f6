"""Hardware profiles: what the time and memory models need to know of a device and its links.

Data-sheet figures (dense 16-bit tensor-core peak, memory, link bandwidth per GPU) and an efficiency
that turns a peak into what large matmuls reach. Bandwidths are *bus* bandwidths as NCCL-tests define
them (an all-reduce of n bytes takes 2 (k - 1) / k x n / bw on k ranks), per GPU, one direction.
Every field can be overridden (`paratrain plan --peak-tflops ...`); `cpu` is measured on this machine
by `paratrain plan --calibrate` (paratrain.planner.calibrate), which saves it where `--hardware cpu`
reads it (CPU_PROFILE).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from paratrain.config.errors import ConfigError

GIB = 2**30
CPU_PROFILE = Path.home() / ".cache" / "paratrain" / "cpu.json"
"""Where `paratrain plan --calibrate` saves this machine's profile and `--hardware cpu` reads it."""


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
    """Share of the peak that the model's matmuls reach (MFU of a well-tuned run is 0.4-0.55 on GPUs)."""
    latency_s: float = 10e-6
    """Fixed cost of one collective or point-to-point message."""
    overhead_s: float = 0.0
    """Fixed time per transformer block and micro-batch (forward and backward) that FLOPs do not
    count: operator launches and Python. Measured by --calibrate on a CPU; 0 (not modelled) in the
    GPU profiles."""
    moe_overhead_s: float = 0.0
    """A MoE layer's fixed time per micro-batch beyond a dense block's (router, top-k, the sort by expert, one
    launch per expert). Measured by --calibrate on a CPU; 0 in the GPU profiles."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# NVIDIA data sheets: A100 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s both ways (300 one way), HDR
# 200 Gb/s per GPU; H100 SXM 989 TFLOP/s, NVLink 4 900 GB/s (450 one way), NDR 400 Gb/s per GPU; H200
# as H100 with 141 GB. Achieved bus bandwidths are below the link's: 0.75 of it is taken here.
PROFILES: dict[str, Hardware] = {
    "a100-40gb": Hardware("a100-40gb", 312e12, 40 * GIB, 0.75 * 300e9, 0.75 * 25e9),
    "a100-80gb": Hardware("a100-80gb", 312e12, 80 * GIB, 0.75 * 300e9, 0.75 * 25e9),
    "h100-80gb": Hardware("h100-80gb", 989e12, 80 * GIB, 0.75 * 450e9, 0.75 * 50e9),
    "h200": Hardware("h200", 989e12, 141e9, 0.75 * 450e9, 0.75 * 50e9),
}


def hardware(name_or_path: str, **overrides: float) -> Hardware:
    """A profile by name, or from a JSON file (what --calibrate saves), with fields overridden."""
    if name_or_path == "cpu" and not CPU_PROFILE.exists():
        raise ConfigError(f"no CPU profile at {CPU_PROFILE}: measure this machine first with `paratrain plan --calibrate` "
                          "(about 10 seconds)")
    if name_or_path in PROFILES:
        profile = PROFILES[name_or_path]
    elif name_or_path == "cpu" or name_or_path.endswith(".json"):
        path = CPU_PROFILE if name_or_path == "cpu" else Path(name_or_path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"hardware profile {name_or_path!r} cannot be read: {error}") from None
        known = {f.name for f in fields(Hardware)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"hardware profile {name_or_path!r} has unknown fields {unknown}: it may hold {sorted(known)}")
        profile = Hardware(**data)
    else:
        raise ConfigError(f"unknown hardware {name_or_path!r}: choose one of {', '.join(PROFILES)}, cpu (after "
                          "`paratrain plan --calibrate`), or a profile file written by `paratrain plan --calibrate "
                          "--save-hardware FILE.json`")
    given = {k: v for k, v in overrides.items() if v is not None}
    for key, value in given.items():
        if not value > 0:
            raise ConfigError(f"hardware {key} must be > 0, got {value}")
    return replace(profile, **given) if given else profile
