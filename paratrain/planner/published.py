"""Published training runs the planner is checked against (tests/unit/test_planner_ops.py, bench/published.py).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv
2205.05198): Megatron-LM GPT models on 80 GB A100s (DGX A100 nodes, fp16, sequence 2048, vocabulary
51,200), Table 3's layouts and Table 5's step times, each model with full recomputation and no sequence
parallelism ("full") and with sequence parallelism and selective recomputation ("seqsel"); Figure 1's
memory per GPU with "seqsel" (parameters, gradients and optimizer state; activations). The layouts as
Calculon (Isaev et al., SC'23) encodes them for its own validation (github.com/calculon-ai/calculon,
validation/seqsel/tab5/*.json and calculon/llm/validation.py), where the step times and memory are
also listed.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(arXiv 2104.04473), Table 1: weak scaling from 1.7B to 1T parameters on 32-3,072 80 GB A100s, tensor and
pipeline parallel sizes, GPUs, batch size and the achieved TFLOP/s per GPU, counted by the paper's formula with
activation recomputation, F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) per step (its section 5.1), so the step
took F / (X n) seconds. Table 2: PTD-P (tp 8 and a pipeline: model-parallel size 96 or 280, micro-batch 1)
against DeepSpeed's ZeRO-3 without model parallelism (micro-batch 4, 2 or 1, one micro-batch a step), for GPT-3
175B (96 layers) and a 530B model on 384-2,240 GPUs, TFLOP/s per GPU by the same formula and the days 300B tokens
take (consistent with it within a day). ZeRO-3's 530B run on 640 GPUs used a batch of 2,560 (the paper's
footnote: it did not fit 560 GPUs). Neither table gives the schedule, nor Table 1 the micro-batch (tuned per
run). Both tables as a public transcription of the paper lists them, every number equal; Table 1's rows are
also consistent with its own aggregate column (X n within 0.4 % of it).

Megatron's GPT has LayerNorm, learned positions and biases where paratrain's has RMSNorm, RoPE and
none: the same matmuls, a few parameters apart (under 0.01 %).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: ModelConfig
    layout: Layout
    global_batch: int
    step_s: float
    """The published seconds per step."""
    states_gib: float | None = None
    """Figure 1's parameters, gradients and optimizer state per GPU (GiB); None: not published."""
    activations_gib: float | None = None
    precision: str = "fp16"


def megatron(d_model: int, n_layer: int, n_head: int) -> ModelConfig:
    return ModelConfig(vocab_size=51200, seq_len=2048, n_layer=n_layer, n_head=n_head, d_model=d_model)


# name: (model, tp, pp, virtual stages, global batch = micro-batches x micro-batch, micro-batch,
#        Table 5 seconds full, seqsel, Figure 1 GiB states, activations)
KORTHIKANTI = {
    "22B": (megatron(6144, 48, 64), 8, 1, 1, 4, 4, 1.42, 1.10, 45.5625, 9.5625),
    "175B": (megatron(12288, 96, 96), 8, 8, 3, 64, 1, 18.13, 13.75, 45.5625, 12.3515625),
    "530B": (megatron(20480, 105, 128), 8, 35, 3, 280, 1, 49.05, 37.83, 31.640625, 23.076171875),
    "1T": (megatron(25600, 128, 160), 8, 64, 1, 512, 1, 94.42, 71.49, 32.958984375, 26.5625),
}


def korthikanti_table5() -> list[PublishedRun]:
    runs = []
    for name, (model, tp, pp, v, batch, micro, full_s, seqsel_s, states, acts) in KORTHIKANTI.items():
        schedule = "interleaved" if v > 1 else "1f1b"
        common = dict(tp=tp, pp=pp, virtual_stages=v, micro_batch=micro, schedule=schedule)
        runs.append(PublishedRun(f"{name} full", model, Layout.of(**common, recompute="full"), batch, full_s))
        runs.append(PublishedRun(f"{name} seqsel", model, Layout.of(**common, recompute="selective",
                                                                     sequence_parallel=True), batch, seqsel_s,
                                 states, acts))
    return runs


# billions of parameters: (heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU, aggregate PFLOP/s)
NARAYANAN = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, 137, 4.4),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, 142, 18.2),
    "18.4B": (48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, 138, 70.8),
    "76.1B": (80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
    "145.6B": (96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
    "310.1B": (128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
    "529.6B": (128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
    "1008.0B": (160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0),
}


def narayanan_table1(micro_batch: int = 1) -> list[PublishedRun]:
    """Table 1's runs with full recomputation, 1F1B and `micro_batch` (not published), no sequence
    parallelism (it came a year later)."""
    runs = []
    for name, (heads, h, layers, tp, pp, gpus, batch, tflops, _) in NARAYANAN.items():
        s, v = 2048, 51200
        flops = 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        layout = Layout.of(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=micro_batch, recompute="full")
        runs.append(PublishedRun(name, megatron(h, layers, heads), layout, batch, flops / (tflops * 1e12 * gpus)))
    return runs


# scheme: (billions, model, model-parallel size, batch, GPUs, micro-batch, TFLOP/s per GPU, days for 300B tokens)
NARAYANAN_TABLE2 = [
    ("ZeRO-3", "174.6B", 1, 1536, 384, 4, 144, 90), ("ZeRO-3", "174.6B", 1, 1536, 768, 2, 88, 74),
    ("ZeRO-3", "174.6B", 1, 1536, 1536, 1, 44, 74), ("ZeRO-3", "529.6B", 1, 2560, 640, 4, 138, 169),
    ("ZeRO-3", "529.6B", 1, 2240, 1120, 2, 98, 137), ("ZeRO-3", "529.6B", 1, 2240, 2240, 1, 48, 140),
    ("PTD-P", "174.6B", 96, 1536, 384, 1, 153, 84), ("PTD-P", "174.6B", 96, 1536, 768, 1, 149, 43),
    ("PTD-P", "174.6B", 96, 1536, 1536, 1, 141, 23), ("PTD-P", "529.6B", 280, 2240, 560, 1, 171, 156),
    ("PTD-P", "529.6B", 280, 2240, 1120, 1, 167, 80), ("PTD-P", "529.6B", 280, 2240, 2240, 1, 159, 42),
]
TABLE2_MODELS = {"174.6B": megatron(12288, 96, 96), "529.6B": megatron(20480, 105, 128)}


def narayanan_table2() -> list[PublishedRun]:
    """Table 2's runs with full recomputation: PTD-P as tp 8 x pp (model-parallel size / 8) in 1F1B, ZeRO-3 as
    data parallelism over every GPU (paratrain's ZeRO-3 moves what DeepSpeed's does with its default reuse
    distance: each block gathered for forward and once more for its recomputed forward and backward)."""
    runs = []
    for scheme, size, mp, batch, gpus, micro, tflops, _ in NARAYANAN_TABLE2:
        model, s, v = TABLE2_MODELS[size], 2048, 51200
        h, layers = model.d_model, model.n_layer
        flops = 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        if scheme == "ZeRO-3":
            layout = Layout.of(dp=gpus, zero=3, micro_batch=micro, recompute="full")
        else:
            layout = Layout.of(dp=gpus // mp, tp=8, pp=mp // 8, micro_batch=micro, recompute="full")
        runs.append(PublishedRun(f"{size} {scheme} {gpus}", model, layout, batch, flops / (tflops * 1e12 * gpus)))
    return runs
