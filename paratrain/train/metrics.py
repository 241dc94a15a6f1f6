"""Throughput and utilisation figures, and the per-step JSON log.

Metrics are records, not log lines: one JSON object per optimizer step, written by rank 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from paratrain.hybrid.step import StepStats

# Dense bf16 tensor-core peak, FLOP/s, from the vendors' data sheets (without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16)
}


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a CUDA device, or None (CPU, or an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices (PaLM, app. B)."""
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (peak * world_size)


def step_record(step: int, lr: float, stats: StepStats, step_time: float, *, world_size: int,
                flops_per_token: float | None = None, peak: float | None = None) -> dict[str, Any]:
    """The JSON record of one optimizer step, as `--log-json` and paratrain.Trainer write it."""
    tokens_per_s = stats.tokens / step_time
    record: dict[str, Any] = {"step": step, "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": lr,
                              "tokens": stats.tokens, "step_time": step_time, "tokens_per_s": tokens_per_s}
    if stats.loss_scale is not None:
        record["loss_scale"] = stats.loss_scale
    if stats.skipped:
        record["skipped"] = True
    if stats.non_finite:
        record["non_finite_ranks"] = list(stats.non_finite_ranks)
    if stats.moe is not None:
        record.update(stats.moe)
    if stats.staleness is not None:
        record.update(stats.staleness)
    utilisation = mfu(tokens_per_s, flops_per_token, world_size, peak) if flops_per_token else None
    if utilisation is not None:
        record["mfu"] = utilisation
    return record


class RecordLog(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Records:
    """Every per-step record to each of several logs (the JSON lines, TensorBoard)."""

    def __init__(self, *logs: RecordLog | None) -> None:
        self.logs = [log for log in logs if log is not None]

    def write(self, record: dict[str, Any]) -> None:
        for log in self.logs:
            log.write(record)

    def close(self) -> None:
        for log in self.logs:
            log.close()


class JsonLog:
    """Appends one JSON object per line; a no-op without a path."""

    def __init__(self, path: str | None, *, append: bool = False, keep_until: int | None = None) -> None:
        """append: continue an existing log (a resumed run); otherwise start the file afresh.
        keep_until: a restarted run drops the records of steps after the one it resumed from, which
        it is about to run again, so the log holds each step once."""
        self._file: IO[str] | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if keep_until is not None and Path(path).is_file():
                kept = [line for line in Path(path).read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= keep_until]
                Path(path).write_text("".join(line + "\n" for line in kept))
            self._file = open(path, "a" if append or keep_until is not None else "w")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
