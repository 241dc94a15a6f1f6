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
took F / (X n) seconds. Transcribed without a copy of the paper at hand (none could be read offline); every row
is consistent with the table's own aggregate column (X n within 0.4 % of it). The table does not give the
micro-batch size or the schedule, which the paper tuned per run.

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
