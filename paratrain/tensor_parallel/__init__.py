"""Tensor parallelism (Megatron-style): column / row / vocab-parallel layers, the vocab-parallel loss,
and the plan that applies them to a model by module name (with or without sequence parallelism)."""

from paratrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paratrain.tensor_parallel.loss import VocabParallelOutput, vocab_parallel_cross_entropy
from paratrain.tensor_parallel.plan import (STYLES, TensorParallelLayout, apply_tensor_parallel, check_ties,
                                            resolve_plan)

__all__ = [
    "STYLES", "ColumnParallelLinear", "RowParallelLinear", "TensorParallelLayout",
    "VocabParallelEmbedding", "VocabParallelOutput", "apply_tensor_parallel", "check_ties", "resolve_plan",
    "vocab_parallel_cross_entropy",
]
