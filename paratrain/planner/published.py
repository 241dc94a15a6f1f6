"""Published training runs the planner is checked against (tests/unit/test_planner_published.py).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv
2205.05198): Megatron-LM GPT models on 80 GB A100s (DGX A100 nodes, fp16, sequence 2048, vocabulary
51,200), Table 3's layouts and Table 5's step times, each model with full recomputation and no sequence
parallelism ("full") and with sequence parallelism and selective recomputation ("seqsel"); Figure 1's
memory per GPU with "seqsel" (parameters, gradients and optimizer state; activations). The layouts as
Calculon (Isaev et al., SC'23) encodes them for its own validation (github.com/calculon-ai/calculon,
validation/seqsel/tab5/*.json and calculon/llm/validation.py), where the step times and memory are
also listed.

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
