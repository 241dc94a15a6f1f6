"""Context parallelism: each sequence split over the cp ranks, attention over the whole of it.

    layout.py   the load-balanced causal split (2 x cp chunks, rank r holds r and 2cp - 1 - r), the
                document-aware split (packed documents' attention work balanced)
    block.py    attention of a block of queries over a block of keys, with its log-sum-exp, and the merge
    fused.py    a block on the CPU's fused flash kernel, cut into runs of positions (and of documents)
    spec.py     AttentionSpec: the causal mask, scale, dropout and documents ring, Ulysses and USP attention take
    ring.py     ring attention: K/V blocks passed round the cp ranks, dK/dV back to their owners
    ring_plan.py  which pairs each ring step computes (rows, columns, pieces), planned on the host
    ulysses.py  Ulysses: all-to-all from sequence shards to head shards and back
    usp.py      USP: Ulysses inside groups of cp ranks, a ring across them
    shard.py    SequenceShard: what the engine and a model's recipe use (positions, shard_batch, attend)
    families.py the Hugging Face families it does not run yet (refused before launch)
"""

from paratrain.context_parallel.block import Scoring, block_attention, block_attention_backward, merge_partials
from paratrain.context_parallel.layout import (attention_pairs, check_divisible, chunk_ids, document_split,
                                               local_positions, shard_sequence, unshard_sequence)
from paratrain.context_parallel.ring import ring_attention
from paratrain.context_parallel.shard import SequenceShard
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.context_parallel.ulysses import check_ulysses_heads, heads_to_sequence, sequence_to_heads, ulysses_attention
from paratrain.context_parallel.usp import usp_attention

__all__ = ["AttentionSpec", "Scoring", "SequenceShard", "attention_pairs", "block_attention", "block_attention_backward", "check_divisible",
           "check_ulysses_heads", "chunk_ids", "document_split", "heads_to_sequence", "local_positions", "merge_partials", "ring_attention",
           "sequence_to_heads", "shard_sequence", "ulysses_attention", "unshard_sequence", "usp_attention"]
