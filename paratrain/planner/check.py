"""The memory check `paratrain train` runs before it launches: the planner's peak for the run's layout
against what one process may use on this node (the GPU's memory, or the CPU's available memory shared
by the node's processes)."""

from __future__ import annotations

from paratrain.config.errors import ConfigError
from paratrain.config.plan import RunPlan
from paratrain.planner.layout import Layout
from paratrain.planner.search import memory
from paratrain.planner.settings import StepSettings
from paratrain.topology.dims import ParallelDims

RUNTIME_BYTES = {"cpu": 0.5e9, "cuda": 1.0e9}
"""What a process needs besides the model: the interpreter and torch (CPU), or the CUDA context and
the caching allocator's slack (GPU). Rough figures, on the side of letting a run start."""


def layout_of(plan: RunPlan) -> Layout:
    return Layout.of_config(plan.parallel, ParallelDims.from_config(plan.parallel), micro_batch=plan.batch.micro_batch,
                            recompute=plan.config.train.recompute)


def predicted_memory(plan: RunPlan, *, device: str) -> dict[str, float]:
    """The planner's bytes of the run's busiest rank: parameters, gradients, optimizer state, activations, peak."""
    parallel = plan.parallel
    grad_reduce = parallel.grad_reduce if parallel.grad_reduce != "auto" else (
        "reduce_scatter" if device == "cuda" else "all_reduce")
    return memory(plan.model, layout_of(plan), global_batch=plan.batch.global_batch, seq=plan.seq_len,
                  settings=StepSettings(precision=plan.config.train.precision, bucket_mb=parallel.bucket_mb,
                                        grad_reduce=grad_reduce, pp_split=tuple(parallel.pp_split),
                                        keep_grads=parallel.keep_grads, optimizer=plan.config.optim.optimizer,
                                        grad_dtype=plan.config.train.grad_dtype,
                                        state_dtype=plan.config.optim.state_dtype))


def check_memory(plan: RunPlan, *, device: str, available_bytes: float, processes: int) -> dict[str, float]:
    """The predicted peak of the busiest rank; ConfigError when it exceeds what a process may use.
    available_bytes: the GPU's memory (device 'cuda'), or the node's available memory, which its
    `processes` share (device 'cpu')."""
    predicted = predicted_memory(plan, device=device)
    # the trainer builds on the meta device and materialises only this rank's pieces: nothing bigger
    # than the training state is ever held (docs/scale.md)
    per_process, where = _budget(device, available_bytes, processes)
    need = predicted["peak"] + RUNTIME_BYTES[device]
    if need > per_process:
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in predicted.items() if k != "peak")
        raise ConfigError(
            f"the layout is predicted to need {need / 1e9:.2f} GB per process (training: {parts} GB; "
            f"+ {RUNTIME_BYTES[device] / 1e9:.1f} GB runtime), "
            f"but each has {per_process / 1e9:.2f} GB of {where}: shard more (--zero 3, or more ranks), recompute "
            "(--recompute), a smaller --micro-batch or model, or compare layouts with `paratrain plan`; "
            "--no-memory-check launches anyway")
    return predicted


def check_memory_hf(plan: RunPlan, *, device: str, available_bytes: float, processes: int) -> list[dict[str, int]]:
    """check_memory for a --hf model: the first rank of each pipeline stage dry-run and measured
    (paratrain.planner.hf), the busiest against what a process may use."""
    from paratrain.planner.hf import hf_memory

    ranks = hf_memory(plan.config.model.hf, plan.parallel, global_batch=plan.batch.global_batch,
                      micro_batch=plan.batch.micro_batch, seq_len=plan.seq_len, precision=plan.config.train.precision,
                      recompute=plan.config.train.recompute)
    per_process, where = _budget(device, available_bytes, processes)
    busiest = max(ranks, key=lambda r: r.peak)
    need = busiest.peak + RUNTIME_BYTES[device]
    if need > per_process:
        raise ConfigError(
            f"rank {busiest.rank} (pipeline stage {busiest.stage}) is measured on the meta device to need "
            f"{need / 1e9:.2f} GB (model states {busiest.states['in_step'] / 1e9:.2f}, saved activations "
            f"{busiest.activations / 1e9:.2f}, + {RUNTIME_BYTES[device] / 1e9:.1f} runtime), but each process has "
            f"{per_process / 1e9:.2f} GB of {where}: shard more (--zero 3, or more ranks), recompute (--recompute), "
            "a smaller --micro-batch or --seq-len; --no-memory-check launches anyway")
    return [{"rank": r.rank, "stage": r.stage, **r.states, "activations": r.activations, "peak": r.peak}
            for r in ranks]


def _budget(device: str, available_bytes: float, processes: int) -> tuple[float, str]:
    """(bytes one process may use, what they are): the GPU's, or the node's CPU memory shared by its processes."""
    if device == "cuda":
        return available_bytes, "GPU memory"
    return available_bytes / processes, f"available CPU memory shared by {processes} processes"


def available_memory(device: str) -> float | None:
    """Bytes a run may use on this node: the first GPU's total memory, or the CPU's MemAvailable
    (Linux; None elsewhere, and the check is skipped)."""
    if device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None
