"""`paratrain plan --dry-run --rank R`: one rank of a large layout, built and stepped on shapes only.

The layout is built for rank R of the whole world in this one process: a fake process group (torch's
"fake" backend: every collective returns at once, moving nothing), the model on the meta device
(nothing allocated, nothing initialised), the real parallelize, and one real training step of the
engine on meta tensors (forward, backward, gradient reduction, the optimizer). What comes out is what
rank R would hold and do: its parameter, gradient and optimizer bytes (engine.memory_report), every
collective it issued in order (axis, group size, operation, shape, dtype, bytes moved, counted as the
ZeRO paper does), the bytes it sent to its pipeline neighbours, and its pipeline actions. Model-state
bytes are compared with the planner's model_state_bytes, and the step's communication volume, by axis
and operation, with paratrain.planner.comm.step_volume: both exactly. GPT-3 175B as dp16 x tp8 x pp8
on 1,024 ranks runs here in about 5 s per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig
from paratrain.config.run import OptimSection
from paratrain.memory import precision_policy
from paratrain.planner.comm import StepSettings, step_volume
from paratrain.planner.layout import Layout
from paratrain.planner.memory import model_state_bytes

if TYPE_CHECKING:
    from paratrain.topology import Context

_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "broadcast": 1}


@dataclass
class Collective:
    axis: str
    group_size: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    """Moved by this rank, as the ZeRO paper counts (all-reduce 2n, reduce-scatter n in, all-gather n out)."""


@dataclass
class DryRun:
    rank: int
    world_size: int
    coords: dict[str, int]
    memory: dict[str, int]
    """engine.memory_report(): params, grads (in a step), optimizer, in_step and between_steps bytes on this rank."""
    predicted_memory: dict[str, int]
    """The planner's model_state_bytes for this rank's pipeline stage."""
    collectives: list[Collective] = field(default_factory=list)
    volume: dict[str, dict[str, int]] = field(default_factory=dict)
    """{axis: {op: bytes}} of the step: every collective, and the pipeline's sends (pp, "send")."""
    predicted_volume: dict[str, dict[str, int]] = field(default_factory=dict)
    """The planner's paratrain.planner.comm.step_volume for this rank."""
    actions: list[str] = field(default_factory=list)
    """This rank's pipeline program for the step (empty without pp)."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.memory == self.predicted_memory and self.volume == self.predicted_volume

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "exact": self.exact}


@contextlib.contextmanager
def fake_rank(parallel: ParallelConfig, *, rank: int, world_size: int, global_batch: int,
              micro_batch: int) -> Iterator[Context]:
    """Rank `rank` of a `world_size`-rank job of `parallel` in this process (which must not be in a process group
    already): torch's fake process group (every collective returns at once, moving nothing) and the layout's
    context on the meta device; the group is destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from paratrain.topology import init

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        ctx = dataclasses.replace(init(device="cpu", config=parallel), device=torch.device("meta"))
        dp = ctx.mesh.degree("dp")
        if global_batch % (dp * micro_batch):
            raise ValueError(f"global batch {global_batch} must be a multiple of dp x micro-batch ({dp} x {micro_batch})")
        yield ctx
    finally:
        dist.destroy_process_group()


def dry_run(model: ModelConfig, parallel: ParallelConfig, *, rank: int, world_size: int, global_batch: int,
            micro_batch: int = 1, precision: str = "fp32", recompute: str = "none") -> DryRun:
    """Build and step rank `rank` of a `world_size`-rank job of `parallel` on the meta device with a
    fake process group (in this process, which must not be in a process group already)."""
    from paratrain.hybrid import EngineOptions, parallelize
    from paratrain.models import build_gpt, lm_loss
    from paratrain.train.optim import adamw_factory

    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank must be in [0, {world_size}), got {rank}")
    policy = precision_policy(precision)
    if policy.loss_scaling:
        raise ConfigError(f"{precision} cannot be dry-run: its loss scale is read from the device at the first "
                          "step, and a dry run has no values; dry-run bf16, which moves the same bytes (fp16 adds one "
                          "4-byte overflow flag per axis)")
    started = time.perf_counter()
    with fake_rank(parallel, rank=rank, world_size=world_size, global_batch=global_batch,
                   micro_batch=micro_batch) as ctx:
        dp = ctx.mesh.degree("dp")
        if ctx.config.zero and ctx.config.shard_group == 1:
            raise ConfigError("shard_group 1 (ZeRO with replicated state): the planner's volume model does not "
                              "cover it, so a dry run cannot check it; use zero 0, or a shard group of 2 or more")
        gpt = build_gpt(model, seed=0, device="meta")
        engine = parallelize(gpt, ctx, optimizer=adamw_factory(OptimSection()),  # as the trainer
                             options=EngineOptions(micro_batch=micro_batch, precision=precision, recompute=recompute))
        rows = global_batch // dp
        tokens = torch.zeros(rows, model.seq_len, dtype=torch.long, device="meta")
        engine.step((tokens, tokens), lm_loss)  # never read back: nothing waits on the device
        recorder = ctx.mesh.recorder
        assert recorder is not None and recorder.window is not None
        entries = sorted((e for group in recorder.window.values() for e in group), key=lambda e: e.order)
        collectives = [_collective(e) for e in entries]
        stage = ctx.mesh.index("pp")
        layout = Layout.of_config(ctx.config, ctx.dims, micro_batch=micro_batch, recompute=recompute)
        grad_reduce = "reduce_scatter" if ctx.config.grad_reduce == "reduce_scatter" else "all_reduce"
        settings = StepSettings(precision=precision, bucket_mb=ctx.config.bucket_mb, grad_reduce=grad_reduce,
                                reshard_after_forward=ctx.config.reshard_after_forward,
                                pp_split=tuple(ctx.config.pp_split), keep_grads=ctx.config.keep_grads)
        predicted_memory = model_state_bytes(model, layout, stage=stage, settings=settings)
        predicted_volume = step_volume(model, layout, stage=stage, micro_batches=rows // micro_batch, settings=settings)
        volume: dict[str, dict[str, int]] = {}
        for c in collectives:
            ops = volume.setdefault(c.axis, {})
            ops[c.op] = ops.get(c.op, 0) + c.bytes
        actions = []
        if engine.pipeline is not None:
            actions = [f"{a.kind} chunk {a.chunk} mb {a.mb}" for a in engine.pipeline.program(rows // micro_batch)]
            volume.setdefault("pp", {})["send"] = engine.pipeline.times.sent_bytes
        notes = []
        if policy.low and not ctx.config.zero:
            notes.append(f"zero 0 with {precision}: the meta device runs no autocast, so activations are counted in "
                         f"float32; a real run's autocast moves the row outputs in {precision} (less)")
        coords = {axis: ctx.mesh.index(axis) for axis in ("dp", "cp", "tp", "pp")  # dp, tp and pp always
                  if axis in ("dp", "tp", "pp") or ctx.dims.degree(axis) > 1}
        return DryRun(rank, world_size, coords, engine.memory_report(), predicted_memory, collectives, volume,
                      predicted_volume, actions, time.perf_counter() - started, notes)


def _collective(entry: Any) -> Collective:
    size = len(entry.ranks)
    element = torch.empty(0, dtype=getattr(torch, entry.dtype)).element_size()
    numel = math.prod(entry.shape)
    moved = numel * element * (size if entry.op == "all_gather" else _FACTOR.get(entry.op, 1))
    return Collective(entry.axis, size, entry.op, entry.shape, entry.dtype, moved)


def format_dry_run(run: DryRun, *, limit: int = 40) -> str:
    gib = 2**30
    lines = [f"rank {run.rank} of {run.world_size} ({', '.join(f'{k} {v}' for k, v in run.coords.items())}), "
             f"built and stepped on the meta device in {run.seconds:.1f} s"]
    for key in ("params", "grads", "optimizer", "between_steps"):
        got, want = run.memory.get(key, 0), run.predicted_memory.get(key, 0)
        lines.append(f"  {key:<10} {got / gib:10.3f} GiB  {got:>16,} bytes  planner {want:>16,}"
                     + ("  (equal)" if got == want else "  DIFFERS"))
    lines.append(f"collectives: {len(run.collectives)} in this step; bytes moved (ZeRO-paper counting):")
    for axis in sorted(run.volume.keys() | run.predicted_volume.keys()):
        got_ops, want_ops = run.volume.get(axis, {}), run.predicted_volume.get(axis, {})
        for op in sorted(got_ops.keys() | want_ops.keys()):
            got, want = got_ops.get(op, 0), want_ops.get(op, 0)
            lines.append(f"  {axis:<5} {op:<15} {got:>16,} bytes  planner {want:>16,}"
                         + ("  (equal)" if got == want else "  DIFFERS"))
    for c in run.collectives[:limit]:
        lines.append(f"  {c.axis:<12} x{c.group_size:<4} {c.op:<15} {str(c.shape):<22} {c.dtype:<9} {c.bytes:>14,} B")
    if len(run.collectives) > limit:
        lines.append(f"  ... {len(run.collectives) - limit} more (--json lists every one)")
    if run.actions:
        lines.append(f"pipeline actions ({len(run.actions)}): " + "; ".join(run.actions[:12])
                     + (" ..." if len(run.actions) > 12 else ""))
    lines += [f"note: {note}" for note in run.notes]
    return "\n".join(lines)
