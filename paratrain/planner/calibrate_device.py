"""`paratrain plan --calibrate` on a CUDA device: the per-operation rates of paratrain.planner.ops, measured.

In well under a minute on one GPU (the functions take any device; the tests run them on the CPU, small):
    gemm                  16-bit products [T, d] x [d, d] for d = 256 .. 8192 (T = 8192): forward x W^T,
                          data gradient dy W, weight gradient dy^T x, each as a share of peak, keyed by
                          arithmetic intensity (paratrain.planner.ops.gemm_efficiency)
    memory_bw             a 1 GiB copy's bytes read and written per second
    attention_efficiency  causal fused attention (scaled_dot_product_attention) forward and backward,
                          [4, 16, 2048, 128], its FLOPs (half of 4 s^2 d a each way forward, 2.5x backward)
                          over the time, as a share of peak
    launch_s              the host time of one eager kernel of autograd: a tiny GPT block's forward and
                          backward, whose kernels take no device time to speak of, over the kernels the model
                          counts for it (paratrain.planner.ops.KERNELS["eager"])
Device times are taken with CUDA events over a queue the host filled while the device slept, so launches do not
count in them. peak_flops is the data sheet's for a card paratrain knows (A100, H100, H200), else the best
product measured; the links and GPUs per node are the data sheet's for a known card (not measured: one process),
else the H100's links and the GPUs visible (override at plan time: --intra-node-gbps, --inter-node-gbps,
--gpus-per-node). The result is a JSON profile: `paratrain plan --hardware gpu` (or the file) prices layouts
with it. These are the primitives the shipped profiles' rates stand for; the shipped rates were fitted to whole
steps instead (paratrain.planner.fit), where the model's byte and kernel counts are estimates, so the two differ:
a calibrated profile has not yet been set against a measured step (no GPU in the session that wrote this).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from paratrain.planner.hardware import GIB, OVERLAP_LOSS, PROFILES, Hardware

GEMM_DIMS = (256, 512, 1024, 2048, 4096, 8192)


def best_seconds(fn: Callable[[], object], device: torch.device, *, repeats: int = 5) -> float:
    """The fastest of `repeats` timings, per call, of enough calls to fill about 2 ms. On CUDA: device time
    between two events, the calls queued while the device sleeps (their launches hidden)."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        inner = max(3, min(200, math.ceil(2e-3 / max(time.perf_counter() - start, 1e-9))))
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            best = min(best, (time.perf_counter() - start) / inner)
        return best
    fn()
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    inner, best = 1, float("inf")
    for attempt in range(repeats + 1):
        torch.cuda._sleep(20_000_000)  # ~10 ms of device cycles: the host queues the calls meanwhile
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        seconds = begin.elapsed_time(end) / 1e3 / inner
        if attempt == 0:  # size the batch to about 2 ms of device time
            inner = max(3, min(200, math.ceil(2e-3 / max(seconds, 1e-9))))
        else:
            best = min(best, seconds)
    return best


def gemm_rates(device: torch.device, dtype: torch.dtype, *, tokens: int = 8192,
               dims: tuple[int, ...] = GEMM_DIMS) -> list[tuple[float, float, float, float]]:
    """(intensity, forward, data-gradient, weight-gradient FLOP/s) for each d."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for d in dims:
        x = torch.randn(tokens, d, device=device, dtype=dtype, generator=gen)
        w = torch.randn(d, d, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(tokens, d, device=device, dtype=dtype, generator=gen)
        flops = 2.0 * tokens * d * d
        forward = flops / best_seconds(lambda: x @ w.t(), device)
        data = flops / best_seconds(lambda: dy @ w, device)
        weight = flops / best_seconds(lambda: dy.t() @ x, device)
        rows.append((1.0 / (1.0 / tokens + 2.0 / d), forward, data, weight))
    return rows


def memory_bandwidth(device: torch.device, *, nbytes: int = GIB) -> float:
    """Bytes read and written per second by a copy of `nbytes`."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device)


def attention_rate(device: torch.device, dtype: torch.dtype, *, shape: tuple[int, int, int, int] = (4, 16, 2048, 128)
                   ) -> float:
    """FLOP/s of causal fused attention, forward and backward ([batch, heads, seq, head dim])."""
    b, a, s, hd = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    forward_flops = 0.5 * 4.0 * b * a * s * s * hd
    return 3.5 * forward_flops / best_seconds(step, device, repeats=3)


def launch_seconds(device: torch.device, dtype: torch.dtype, *, repeats: int = 5) -> float:
    """Host seconds per eager kernel of a block: a tiny GPT block's forward and backward under autocast, its
    wall time over the kernels paratrain.planner.ops counts for a block (its device work is negligible)."""
    from paratrain.config.model import ModelConfig
    from paratrain.models.gpt import Block
    from paratrain.models.norms import rope_tables
    from paratrain.planner.ops import KERNELS

    config = ModelConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    block = Block(config).to(device)
    x = torch.randn(1, 16, 32, device=device, requires_grad=True)
    cos, sin = (t.to(device) for t in rope_tables(config.seq_len, config.head_dim, config.rope_theta))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = block(x, cos, sin)
        y.sum().backward()

    step()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            step()
        sync()
        best = min(best, (time.perf_counter() - start) / 10)
    return best / sum(KERNELS["eager"].kernels)


def known_card(name: str, memory_bytes: float) -> Hardware | None:
    """The shipped profile of a card by its device name (its data sheet's peak and links), if paratrain knows it."""
    name = name.upper()
    if "H200" in name:
        return PROFILES["h200"]
    if "H100" in name:
        return PROFILES["h100-80gb"]
    if "A100" in name:
        return PROFILES["a100-80gb" if memory_bytes > 50e9 else "a100-40gb"]
    return None


def calibrate_device(device: torch.device, *, dtype: torch.dtype = torch.bfloat16, tokens: int = 8192,
                     dims: tuple[int, ...] = GEMM_DIMS, copy_bytes: int = GIB,
                     attention_shape: tuple[int, int, int, int] = (4, 16, 2048, 128)) -> Hardware:
    """Measure `device` and return its per-operation profile (module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        per_node = max(1, torch.cuda.device_count())
    else:
        from paratrain.planner.calibrate import available_memory

        name, memory, per_node = "cpu", available_memory(), 1
    rates = gemm_rates(device, dtype, tokens=tokens, dims=dims)
    card = known_card(name, memory)
    peak = card.peak_flops if card else max(max(r[1:]) for r in rates)
    # links and the overlap loss are not measured here: a known card's, else the H100's links and the fitted loss
    base = card or Hardware(name, peak, memory, 0.75 * 450e9, 0.75 * 50e9, devices_per_node=per_node,
                            overlap_loss=OVERLAP_LOSS)
    return replace(base, name=name, memory_bytes=memory,
                   memory_bw=memory_bandwidth(device, nbytes=copy_bytes),
                   gemm=tuple((r[0], r[1] / peak, r[2] / peak, r[3] / peak) for r in rates),
                   attention_efficiency=attention_rate(device, dtype, shape=attention_shape) / peak,
                   launch_s=launch_seconds(device, dtype))
