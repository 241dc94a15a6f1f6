"""The compute of a step by operation (issue 28): what a GPU profile with per-operation rates predicts.

One efficiency for every FLOP cannot describe a 124M model and a 1T one: a narrow model spends its step
in memory-bound operations, the vocabulary's loss and kernel launches, a wide one in large matmuls that
run near the card's best. So each pipeline rank's work per micro-batch is priced by what bounds it:

    GEMMs         2 m n k FLOPs at peak x the profile's efficiency for that shape and kind (forward,
                  data gradient, weight gradient): Hardware.gemm, a table by arithmetic intensity
                  (measured by `paratrain plan --calibrate` on a GPU, or hardware.roofline_table's); a
                  grid mode's rank runs its SUMMA or cube products (Cut)
    attention     the fused kernel's FLOPs (causal: half of 4 s h per token forward, 2.5x that backward) at
                  peak x attention_efficiency
    memory-bound  norms, residual adds, RoPE, GELU, layout copies, the chunked loss, gradient accumulation,
                  the weight casts and the optimizer step: bytes read and written over memory_bw
    launches      kernels x launch_s: the device idles between short kernels an eager run launches one by
                  one (compiled blocks launch fewer)

Eager, compiled and Megatron's fused kernels move and launch different amounts (KERNELS).

Recomputation repeats the forward (full) or the attention core's forward (selective). The byte and kernel
counts are estimates from the operations of paratrain's GPT (paratrain.models.gpt: RMSNorm, RoPE, GELU MLP, fused
attention, the chunked loss, fused AdamW); the rates fitted to measured steps (paratrain.planner.fit) absorb
their error.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from paratrain.config.model import ModelConfig
from paratrain.planner.float8 import block_linears, cast_bytes, float8_speedup
from paratrain.planner.hardware import Hardware
from paratrain.pipeline.schedules import Schedule
from paratrain.planner.layout import Layout, chunk_layers, stage_chunks
from paratrain.topology.dims import ParallelDims


@dataclass(frozen=True)
class Kernels:
    """What one way of running a block moves and launches beyond its matmuls and attention kernel.

    element_bytes: bytes read and written per element by the memory-bound operations of one block,
    (forward, backward), in 16-bit units (x 2 for float32): "stream" per element of the [T, h] residual
    stream a tp rank holds (two RMSNorms: the input read, its square, the mean, the scaled output; two
    residual adds); "heads" per element of q (its h / tp columns: RoPE of q and k, the transposes to the
    attention kernel's layout and back); "ffn" per element of the MLP's hidden [T, f / tp] (GELU)."""
    element_bytes: dict[str, tuple[float, float]]
    kernels: tuple[int, int]
    """Kernels of one block, (forward, backward), the matmuls and attention included."""
    accumulate_bytes: float
    """Per parameter element and micro-batch: the weight gradient added into its float32 accumulator."""
    optimizer_bytes: float
    """Per parameter element a rank steps, once per step: the optimizer, clipping, the 16-bit weight copy."""
    recompute_pointwise: bool
    """Whether full recomputation moves the forward's pointwise bytes again (torch.compile fuses them into
    backward's kernels; eager and Megatron run the forward's kernels again)."""


KERNELS = {
    # paratrain eager: autograd's kernels one by one; gradients cast to float32 and added into .grad (2 + 4 + 8
    # bytes); fused AdamW (p, g, m, v read, p, m, v written: 28), clipping with the token-count scale (12), the
    # weights cast to 16-bit once per step (6)
    "eager": Kernels({"stream": (48.0, 96.0), "heads": (40.0, 80.0), "ffn": (4.0, 10.0)}, (40, 90), 14.0, 46.0, True),
    # paratrain with --compile: each block's pointwise operations fused by torch.compile, the rest as eager
    "compiled": Kernels({"stream": (20.0, 40.0), "heads": (16.0, 32.0), "ffn": (4.0, 8.0)}, (10, 20), 14.0, 46.0,
                        False),
    # Megatron-LM (the published runs): fused kernels, weight gradients accumulated into float32 main_grad by the
    # GEMM itself; its fp16 optimizer over float32 main parameters (unscale and inf check 8, clipping 12, Adam
    # 28, the fp16 copy 6, main_grad zeroed 4)
    "fused": Kernels({"stream": (20.0, 40.0), "heads": (16.0, 32.0), "ffn": (4.0, 8.0)}, (10, 20), 0.0, 58.0,
                     True),
}
LOSS_BYTES = 32.0
"""The chunked loss (eager in every mode), bytes per logit: the logits written, each chunk upcast, its
log-sum-exp, and in backward upcast again, softmax, minus the target, cast back."""


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


    @property
    def intensity(self) -> float:
        """FLOPs per byte moved in 16-bit: 2 m n k / (2 (m k + k n + m n)), what bounds a product's rate."""
        return 1.0 / (1.0 / self.m + 1.0 / self.n + 1.0 / self.k)


def gemm_efficiency(hw: Hardware, gemm: Gemm, kind: int) -> float:
    """kind 1 forward, 2 data gradient, 3 weight gradient: the table's column at the product's intensity,
    interpolated in log(intensity)."""
    x = gemm.intensity
    keys = [row[0] for row in hw.gemm]
    i = bisect.bisect_left(keys, x)
    if i == 0:
        return hw.gemm[0][kind] * x / keys[0]  # below the table: bandwidth-bound, proportionally less
    if i == len(keys):
        return hw.gemm[-1][kind]
    lo, hi = hw.gemm[i - 1], hw.gemm[i]
    w = math.log(x / lo[0]) / math.log(hi[0] / lo[0])
    return lo[kind] + w * (hi[kind] - lo[kind])


def gemm_seconds(hw: Hardware, gemms: list[Gemm]) -> tuple[float, float]:
    """(forward, backward) seconds of products: backward is the data and the weight gradient."""
    fwd = sum(g.flops / (hw.peak_flops * gemm_efficiency(hw, g, 1)) for g in gemms)
    bwd = sum(g.flops / (hw.peak_flops * gemm_efficiency(hw, g, 2)) + g.flops / (hw.peak_flops * gemm_efficiency(
        hw, g, 3)) for g in gemms)
    return fwd, bwd


@dataclass(frozen=True)
class Work:
    """Seconds of one micro-batch (or of a step's once-only work) by kind, forward and backward together."""
    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    launches: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.gemm + other.gemm, self.attention + other.attention, self.memory + other.memory,
                    self.launches + other.launches)

    def __mul__(self, factor: float) -> Work:
        return Work(self.gemm * factor, self.attention * factor, self.memory * factor, self.launches * factor)

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.memory + self.launches


@dataclass(frozen=True)
class Cut:
    """How tensor parallelism cuts a rank's work: its products, stream share and extra launches per block."""
    mode: str = "1d"
    tp: int = 1
    side: int = 1
    """A grid's q (2d, 2.5d: q x q grids; 3d: a q^3 cube)."""
    depth: int = 1
    sequence_parallel: bool = False

    @classmethod
    def of(cls, layout: Layout) -> Cut:
        return cls(*layout.dims.tp_shape, layout.sequence_parallel)

    def products(self, tokens: int, d_in: int, d_out: int) -> tuple[Gemm, int]:
        """(the product one rank runs, how many times) for a linear [tokens, d_in] -> [tokens, d_out]: 1d a
        [tokens, d_in] x [d_in, d_out / tp] (or d_in / tp for the row-parallel ones: the caller passes which);
        SUMMA (2d, 2.5d) q products of [tokens / (depth q), d_in / q] x [d_in / q, d_out / q]; the cube one
        [tokens / q, d_in / q] x [d_in / q, d_out / q]."""
        if self.mode == "1d":
            return Gemm(tokens, max(1, d_out), max(1, d_in)), 1
        q = self.side
        rows = q if self.mode == "3d" else self.depth * q
        return Gemm(max(1, tokens // rows), max(1, d_out // q), max(1, d_in // q)), 1 if self.mode == "3d" else q

    def stream(self, tokens: int, width: int) -> float:
        """Elements of the residual stream a rank holds: all of it in 1d, 1/tp with sequence parallelism or a grid."""
        return tokens * width / (self.tp if self.sequence_parallel or self.mode != "1d" else 1)


def _gemm_work(hw: Hardware, cut: Cut, tokens: int, shapes: list[tuple[int, int, bool]],
               speedup: float = 1.0) -> tuple[float, float, int]:
    """(forward, backward seconds, extra kernels per pass) of linears (d_in, d_out, cut along d_out in 1d), at
    `speedup` x the 16-bit rate (float8: paratrain.planner.float8)."""
    fwd = bwd = 0.0
    extra = 0
    for d_in, d_out, column in shapes:
        if cut.mode == "1d":
            gemm, reps = cut.products(tokens, d_in if column else d_in // cut.tp, d_out // cut.tp if column else d_out)
        else:
            gemm, reps = cut.products(tokens, d_in, d_out)
        f, b = gemm_seconds(hw, [gemm])
        fwd, bwd, extra = fwd + reps * f / speedup, bwd + reps * b / speedup, extra + reps - 1
    return fwd, bwd, extra


@dataclass(frozen=True)
class Numerics:
    """How a rank's blocks compute: kernels (KERNELS' name: eager, compiled or Megatron's fused), the bytes of an
    activation element (act: 2 in 16-bit precisions, 4 in float32), and float8: the recipe the blocks' linears
    multiply in float8 with (precision fp8: their rate and casts, paratrain.planner.float8), "" otherwise."""

    kernels: str = "eager"
    act: int = 2
    float8: str = ""


@functools.lru_cache(maxsize=4096)  # the search prices the same block under many ZeRO stages, schedules and dp
def block_work(model: ModelConfig, hw: Hardware, *, tokens: int, seq: int, cut: Cut, recompute: str,
               numerics: Numerics, mlp: bool = True) -> Work:
    """One block and one micro-batch of `tokens` rows on one tp rank (attention over `seq` keys); without its
    MLP when `mlp` is false (a MoE block: paratrain.planner.moe_cost prices the layer in its place)."""
    kernels, act, float8 = numerics.kernels, numerics.act, numerics.float8
    h, f, tp = model.d_model, model.ff_dim, cut.tp
    linears = block_linears(model, mlp=mlp)
    speedup = float8_speedup(hw.name, hw.float8_speedup) if float8 else 1.0
    g_fwd, g_bwd, extra = _gemm_work(hw, cut, tokens, linears, speedup)
    rate = hw.peak_flops * hw.attention_efficiency
    a_fwd = 0.5 * 4.0 * tokens * seq * h / tp / rate  # causal: half of q k^T and p v
    sizes = {"stream": cut.stream(tokens, h), "heads": tokens * h / tp, "ffn": tokens * f / tp if mlp else 0.0}
    mode = KERNELS[kernels]
    counts = mode.element_bytes
    m_fwd = sum(sizes[k] * counts[k][0] for k in sizes) * act / 2 / hw.memory_bw
    m_bwd = sum(sizes[k] * counts[k][1] for k in sizes) * act / 2 / hw.memory_bw
    m_bwd += (4 * h * h + (2 * h * f if mlp else 0)) / tp * mode.accumulate_bytes / hw.memory_bw
    if float8:  # each operand's amax and cast, on this rank's blocks
        if cut.mode == "1d":
            local = [(d_in, d_out // tp) if column else (d_in // tp, d_out) for d_in, d_out, column in linears]
            rows = tokens
        else:  # SUMMA: every block cast once by its owner
            blocks = [cut.products(tokens, d_in, d_out)[0] for d_in, d_out, _ in linears]
            local, rows = [(g.k, g.n) for g in blocks], blocks[0].m
        c_fwd, c_bwd = cast_bytes(local, rows, float8)
        m_fwd, m_bwd = m_fwd + c_fwd / hw.memory_bw, m_bwd + c_bwd / hw.memory_bw
    # a grid's products and their sums; a MoE block's MLP kernels are the MoE layer's (4 forward, 10 backward)
    k_fwd = mode.kernels[0] + 2 * extra - (0 if mlp else 4)
    k_bwd = mode.kernels[1] + 4 * extra - (0 if mlp else 10)
    forward = Work(g_fwd, a_fwd, m_fwd, k_fwd * hw.launch_s)
    work = forward + Work(g_bwd, 2.5 * a_fwd, m_bwd, k_bwd * hw.launch_s)
    if recompute == "full":
        work = work + (forward if mode.recompute_pointwise else Work(g_fwd, a_fwd, 0.0, k_fwd * hw.launch_s))
    elif recompute == "selective":
        work = work + Work(0.0, a_fwd, 0.0, hw.launch_s)
    return work


@functools.lru_cache(maxsize=4096)
def head_work(model: ModelConfig, hw: Hardware, *, tokens: int, cut: Cut, act: int, kernels: str) -> Work:
    """The last stage's final norm, vocabulary matmul and chunked loss, one micro-batch (eager)."""
    v, h, tp = model.padded_vocab, model.d_model, cut.tp
    g_fwd, g_bwd, extra = _gemm_work(hw, cut, tokens, [(h, v, True)])
    logits = tokens * v / tp
    memory = (logits * LOSS_BYTES + cut.stream(tokens, h) * KERNELS["eager"].element_bytes["stream"][0]) \
        / hw.memory_bw * act / 2
    memory += v * h / tp * KERNELS[kernels].accumulate_bytes / hw.memory_bw
    return Work(g_fwd + g_bwd, 0.0, memory, (30 + 6 * extra) * hw.launch_s)


def optimizer_work(hw: Hardware, elements: float, kernels: str) -> Work:
    """Once per step: the optimizer, clipping and the weight casts over the `elements` a rank steps."""
    if not elements:
        return Work()
    return Work(memory=elements * KERNELS[kernels].optimizer_bytes / hw.memory_bw, launches=20 * hw.launch_s)


def rank_work(model: ModelConfig, layout: Layout, hw: Hardware, *, micro_batches: int, seq: int, numerics: Numerics,
              stage_elements: float, moe_layer: Work = Work()) -> tuple[Work, Work]:
    """(the micro-batches' work of the pipeline rank whose compute is longest: its blocks and, on the last rank,
    the head; once per step, its optimizer step over `stage_elements` parameter elements). moe_layer: a MoE
    layer's work per micro-batch (paratrain.planner.moe_cost), in place of the MLP of each MoE block."""
    shape = MicroBatchShape(layout.micro_batch * layout.local_tokens(seq), seq, Cut.of(layout), layout.recompute,
                            numerics)
    best = _busiest_micro_batch(model, hw, shape, layout.pipeline, moe_layer)
    return best * micro_batches, optimizer_work(hw, stage_elements, numerics.kernels)


class MicroBatchShape(NamedTuple):
    """What a block's work reads of one micro-batch (block_work's keywords)."""

    tokens: int
    seq: int
    cut: Cut
    recompute: str
    numerics: Numerics


@functools.lru_cache(maxsize=4096)
def _busiest_micro_batch(model: ModelConfig, hw: Hardware, shape: MicroBatchShape, pipeline: Schedule | None,
                         moe_layer: Work) -> Work:
    """rank_work's one micro-batch on its busiest pipeline rank (pipeline None: the one rank), cached on what it reads
    (the search prices it for every ZeRO stage, dp and micro-batch count alike)."""
    block = block_work(model, hw, **shape._asdict())
    # a MoE block: the block without its MLP, and the MoE layer in its place
    moe_block = block_work(model, hw, **shape._asdict(), mlp=False) + moe_layer if model.n_experts else Work()
    head = head_work(model, hw, tokens=shape.tokens, cut=shape.cut, act=shape.numerics.act,
                     kernels=shape.numerics.kernels)
    if model.mtp_depth:  # each MTP depth: a dense block and the head again (its 2D -> D projection not priced)
        head = head * (1 + model.mtp_depth) + block * model.mtp_depth
    best = Work()
    for blocks, moe_blocks, has_head in _rank_shapes(model, pipeline):
        mine = block * (blocks - moe_blocks) + moe_block * moe_blocks + (head if has_head else Work())
        if mine.total > best.total:
            best = mine
    return best


@functools.lru_cache(maxsize=4096)
def _rank_shapes(model: ModelConfig, pipeline: Schedule | None) -> frozenset[tuple[int, int, bool]]:
    """The distinct (blocks, of them MoE blocks, holds the head) of the pipeline ranks, as the engine cuts the
    layers (layer i of the cut is block i - 1: the embedding is layer 0)."""
    pp, v = (pipeline.stages, pipeline.chunks) if pipeline is not None else (1, 1)
    dims = ParallelDims(pp=pp, virtual_stages=v)
    ranges = chunk_layers(model, dims)
    shapes = set()
    for rank in range(pp):
        chunks = [ranges[c] for c in stage_chunks(dims, rank, pipeline)]
        layers = [i for lo, hi in chunks for i in range(max(lo, 1), min(hi, model.n_layer + 1))]
        shapes.add((len(layers), sum(model.is_moe(i - 1) for i in layers),
                    any(hi == model.n_layer + 2 for _, hi in chunks)))
    return frozenset(shapes)
