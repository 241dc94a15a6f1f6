"""Tensor parallelism (Megatron-style): column / row / vocab-parallel layers and the vocab-parallel loss.

The building blocks of issue 4, tested against the dense layers; applying them to a model by a plan,
sequence parallelism in the GPT and `--tp` come next (`--tp` > 1 is refused until then).
"""

from paratrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paratrain.tensor_parallel.loss import vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
