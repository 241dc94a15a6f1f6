"""The planner for Hugging Face models (`paratrain train --hf`'s memory check, `paratrain plan --hf DIR`).

The GPT's analytic model (paratrain.planner.memory, .activations) does not describe another family's layers, so
for a folder's model each rank that can differ is built and stepped on the meta device instead (the dry run of
paratrain.planner.dryrun: a fake process group, the real from_pretrained, parallelize and engine step, nothing
allocated) and measured:

    states       engine.memory_report(): parameters, gradients, optimizer state, in_step (their peak)
    activations  the peak of the bytes autograd keeps for backward over the step (ActivationMeter, each storage
                 once, from its first save to its last release: a pipeline's micro-batches in flight included)
    peak         in_step + activations (both peaks of the step, added: on the side of refusing)

Ranks measured: the first of each pipeline stage (dp, cp and tp ranks hold the same shapes). Two things of the
meta device are not a GPU's, and the dry run makes them so: torch's attention on meta tensors would take the
math path, which keeps the [B, H, S, S] probabilities, where a GPU (and a CPU) runs a fused kernel that keeps
O(S) (its output and log-sum-exp); and transformers' search for packed sequences in the position ids reads
values, which meta tensors have not (the dry run has no documents); and torch's grouped product of MoE experts
has a meta kernel for bfloat16 only (the dry run multiplies every routed row by one expert's matrix: the same
shapes saved). Activations are counted in the model's
dtype: the meta device runs no autocast (bf16 under zero 0 moves less than counted).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paratrain.config.parallel import ParallelConfig
from paratrain.topology.dims import ParallelDims


@dataclass
class HFRankMemory:
    rank: int
    stage: int
    states: dict[str, int]
    """engine.memory_report() of the rank: params, grads, optimizer, in_step, between_steps bytes."""
    activations: int
    """Peak bytes of saved activations over the step."""
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        return self.states["in_step"] + self.activations


def hf_memory(folder: str, parallel: ParallelConfig, *, global_batch: int, micro_batch: int, seq_len: int,
              precision: str = "fp32", recompute: str = "none") -> list[HFRankMemory]:
    """The first rank of each pipeline stage of `parallel`'s layout, dry-run (module docstring)."""
    dims = ParallelDims.from_config(parallel)
    ranks = [dims.rank(pp=stage) for stage in range(dims.pp)]
    return [hf_rank_memory(folder, parallel, rank=rank, global_batch=global_batch,
                           micro_batch=micro_batch, seq_len=seq_len, precision=precision, recompute=recompute)
            for rank in ranks]


def hf_rank_memory(folder: str, parallel: ParallelConfig, *, rank: int, global_batch: int, micro_batch: int,
                   seq_len: int, precision: str = "fp32", recompute: str = "none") -> HFRankMemory:
    """Build rank `rank` of the layout from the folder on the meta device, step it once, and measure it (in this
    process, which must not be in a process group already). The world is the layout's (parallel is resolved)."""
    from paratrain.config.run import OptimSection
    from paratrain.hf.load import pretrained_for_training
    from paratrain.hybrid import EngineOptions, parallelize
    from paratrain.memory.activations import ActivationMeter
    from paratrain.planner.dryrun import fake_rank
    from paratrain.train.optim import adamw_factory

    started = time.perf_counter()
    world_size = ParallelDims.from_config(parallel).world_size
    with fake_rank(parallel, rank=rank, world_size=world_size, global_batch=global_batch,
                   micro_batch=micro_batch) as ctx:
        dp = ctx.mesh.degree("dp")
        pretrained = pretrained_for_training(folder, parallel.tp)
        engine = parallelize(pretrained.model, ctx, optimizer=adamw_factory(OptimSection()),
                             options=EngineOptions(micro_batch=micro_batch, precision=precision, recompute=recompute),
                             recipe=pretrained.recipe, init=pretrained.init)
        tokens = torch.zeros(global_batch // dp, seq_len, dtype=torch.long, device="meta")
        with meta_kernels(), ActivationMeter(engine.model) as meter:
            engine.step((tokens, tokens), pretrained.loss)  # never read back: nothing waits on the device
        return HFRankMemory(rank, ctx.mesh.index("pp"), engine.memory_report(), meter.peak,
                            time.perf_counter() - started)


@contextlib.contextmanager
def meta_kernels() -> Iterator[None]:
    """On meta tensors: attention as the fused kernel runs it (what it saves), and no packed-sequence search."""
    import transformers.masking_utils as masking

    attention, find_packed = F.scaled_dot_product_attention, masking.find_packed_sequence_indices

    def fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
        if not query.is_meta:
            return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa)
        # the fused kernel reads grouped k / v heads as they are (GQA: enable_gqa), keeping them unrepeated; its meta
        # kernel gives the output q's width: a narrower v (DeepSeek's MLA) is padded to it and the output cut back
        width = value.shape[-1]
        if width < query.shape[-1]:
            value = F.pad(value, (0, query.shape[-1] - width))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0][..., :width]

    grouped = getattr(F, "grouped_mm", None)

    def grouped_on_meta(mat_a: torch.Tensor, mat_b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if not mat_a.is_meta or mat_b.dim() != 3:
            return grouped(mat_a, mat_b, **kwargs)  # type: ignore[misc]
        # the experts' grouped product (rows sorted by expert, E matrices): the same output and saved input as one
        # product of every row with one expert's matrix (torch's meta kernel takes only bfloat16)
        return mat_a @ mat_b[0]

    F.scaled_dot_product_attention = fused  # type: ignore[assignment]
    masking.find_packed_sequence_indices = lambda positions: None if positions.is_meta else find_packed(positions)
    if grouped is not None:
        F.grouped_mm = grouped_on_meta  # type: ignore[attr-defined]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = attention  # type: ignore[assignment]
        masking.find_packed_sequence_indices = find_packed
        if grouped is not None:
            F.grouped_mm = grouped  # type: ignore[attr-defined]
