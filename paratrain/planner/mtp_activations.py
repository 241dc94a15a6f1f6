"""Bytes the multi-token prediction depths keep for backward (paratrain.models.gpt_mtp), on the last pipeline chunk
with the head, counted as paratrain.planner.activations counts the rest and checked to the byte against autograd
(tests/unit/test_planner_memory.py). Each depth keeps:

    ids           the tokens ahead it embeds (int64; under tp the local ids and the out-of-slice mask)
    hidden_norm   1/rms (float32): its input is the tensor the head's norm (or the previous depth's) keeps already
    embed_norm    the embedding's output in its own dtype, and 1/rms
    proj          its input [n, 2D] (16-bit under autocast, with a 16-bit copy of its weight)
    block         a dense block (block_activation_bytes: recomputed, split, sequence-parallel as the others)
    norm, head    the head's terms (head_activation_bytes) without a second copy of the head's weight: autocast
                  keeps one cast of a weight per forward
"""

from __future__ import annotations

from paratrain.config.model import ModelConfig
from paratrain.planner.layout import Layout


def mtp_activation_bytes(model: ModelConfig, layout: Layout, *, seq: int, mode: str, block: float, head: float,
                         head_cast: float) -> float:
    """Bytes the model's MTP depths keep per micro-batch (0 without them); block: a dense block's bytes, head: the
    head's, head_cast: the head's weight copy within it (both as paratrain.planner.activations counts them)."""
    if not model.mtp_depth:
        return 0.0
    d, n = model.d_model, layout.micro_batch * layout.local_tokens(seq)
    tokens = n / (layout.tp if layout.sequence_parallel else 1)
    ids = n * (9 if layout.tp > 1 else 8)
    res = 2 if mode == "low" else 4  # the embedding's output: float32 but for ZeRO's 16-bit parameters
    norms = tokens * 4 + tokens * (d * res + 4)
    proj = tokens * 2 * d * (4 if mode == "fp32" else 2) + mtp_proj_cast(model, mode)
    return model.mtp_depth * (ids + norms + proj + block + head - head_cast)


def mtp_proj_cast(model: ModelConfig, mode: str) -> float:
    """The 16-bit copy of one depth's projection weight autocast keeps (replicated over tp: whole on every rank)."""
    return 2 * model.d_model * model.d_model * 2 if mode == "autocast" else 0.0
