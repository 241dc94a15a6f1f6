"""Models nobody here wrote, as a new user brings them (docs/reliability.md, "user models"): built from
configs, tiny, float64, the same numbers in every process. Each comes with its data and its loss, so
a test can train it under paratrain.Trainer on any layout and compare with one device.

    gpt2         Hugging Face GPT-2: Conv1D layers (weights stored [in, out]), fused q/k/v, learned
                 positions, lm_head tied to the token embedding
    llama-tied   Hugging Face Llama with tie_word_embeddings=True and a padding row
    llama        the same, untied
    bn-cnn       a ResNet-style CNN: BatchNorm after each conv, a residual block, running statistics
    frozen       an MLP whose first layer does not train (requires_grad=False)
    unused       an MLP with a parameter that forward never uses
    counter      an MLP that counts the samples it has seen in a persistent buffer, in forward
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

VOCAB, SEQ = 64, 16
ZOO = ("gpt2", "llama-tied", "llama", "bn-cnn", "frozen", "unused", "counter")
MLP_PLAN = {"0": "column", "2": "row"}
"""The MLPs' tensor-parallel plan: the first Linear split by columns, the second by rows."""


def _hf(kind: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                           attn_implementation="sdpa"))
        assert model.lm_head.weight is model.transformer.wte.weight
        return model
    tied = kind == "llama-tied"
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=SEQ,
                                        use_cache=False, attn_implementation="sdpa", tie_word_embeddings=tied,
                                        pad_token_id=3 if tied else None))


class ResidualCNN(nn.Module):
    """conv-BN-relu, a residual block of two conv-BN, global pooling, a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # [B, 8, 8, 8]
        x = torch.relu(x + self.block(x))
        return self.head(x.mean((2, 3)))  # [B, 4]


class Unused(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.spare = nn.Parameter(torch.randn(4))  # never used in forward: no gradient, never updated


class Counter(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]  # the samples this process has trained on
        return super().forward(x)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind in ("gpt2", "llama-tied", "llama"):
        return _hf(kind).double()
    if kind == "bn-cnn":
        return ResidualCNN().double()
    if kind == "unused":
        return Unused().double()
    if kind == "counter":
        return Counter().double()
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    model[0].requires_grad_(False)
    return model


def data(kind: str, samples: int = 32) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    if kind in ("gpt2", "llama-tied", "llama"):
        ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
        labels = ids[:, 1:].clone()
        labels[::3, :4] = -100  # unequal token counts per sample
        return torch.utils.data.TensorDataset(ids[:, :-1], labels)
    if kind == "bn-cnn":
        x = torch.randn(samples, 3, 8, 8, generator=generator, dtype=torch.float64) * 2 + 0.5
        return torch.utils.data.TensorDataset(x, torch.randint(0, 4, (samples,), generator=generator))
    x = torch.randn(samples, 8, generator=generator, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 4, (samples,), generator=generator))


def loss_fn(kind: str) -> Callable[[nn.Module, Any], Any]:
    if kind in ("gpt2", "llama-tied", "llama"):
        from paratrain.models.hf import llama_loss

        return llama_loss  # (sum of token cross-entropies, labels that are not -100); fits GPT-2 too
    return _classify


def _classify(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def tp_plan(kind: str) -> dict[str, str] | None:
    """The kind's tensor-parallel plan, or None where it has none (GPT-2's Conv1D, the CNN)."""
    if kind in ("llama-tied", "llama"):
        from paratrain.models.hf import LLAMA_TP_PLAN

        return LLAMA_TP_PLAN
    return MLP_PLAN if kind in ("frozen", "unused", "counter") else None


def train(kind: str, *, devices: int, strategy: str, max_steps: int = 4, global_batch: int = 8,
          **options: Any) -> dict[str, Any]:
    """Train the kind under paratrain.Trainer here (a pool rank, or one process): the losses, the trained
    model's layout-free state (every rank gathers it) and whether its tied weights are one tensor."""
    import paratrain

    model = build(kind)
    trainer = paratrain.Trainer(devices=devices, strategy=strategy, max_steps=max_steps, global_batch=global_batch,
                                lr=1e-3, weight_decay=0.1, tp_plan=tp_plan(kind) if strategy == "tp" else None,
                                **options)
    result = trainer.fit(model, loss_fn(kind), data(kind))
    assert trainer.engine is not None
    return {"losses": list(result.losses.values()), "model": trainer.engine.state_dict()["model"]}
