"""Building blocks any model may use, below both the models and the strategies that lay them out:
dropout keyed by logical position, the chunked vocabulary loss and its output module, the
Mixture-of-Experts layer. Strategies know these (tensor parallelism splits a KeyedDropout's mask and
replaces a VocabOutput; expert parallelism slices a MoE layer's experts); they know no model."""

from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.loss import IGNORE_INDEX, VocabOutput, chunked_cross_entropy
from paratrain.nn.moe import MoE, RouterLog

__all__ = ["IGNORE_INDEX", "KeyedDropout", "MoE", "RouterLog", "VocabOutput", "chunked_cross_entropy"]
