"""The document-aware context-parallel split (paratrain.context_parallel.layout.document_split): every position
once, the same on every rank, and the attention work of packed documents balanced where the causal split is not."""

from __future__ import annotations

import pytest
import torch

from paratrain.context_parallel.layout import attention_pairs, document_split, local_positions


def packed(*lengths: int) -> torch.Tensor:
    """Each token's position in its document, documents of `lengths` back to back."""
    return torch.cat([torch.arange(n) for n in lengths])


def causal_split(seq_len: int, cp: int) -> torch.Tensor:
    return torch.stack([local_positions(seq_len, r, cp) for r in range(cp)])


# 8 documents of mixed lengths in one 4,096-token window at cp 4 (the case), long first, long last and a
# geometric mix. Measured slowest / mean attention pairs: documents 1.0001, 1.0002, 1.0018; the causal split 1.49,
# 1.47, 1.50 (its figure does not depend on the machine: integers).
@pytest.mark.parametrize("lengths", [
    (1800, 900, 500, 340, 250, 150, 100, 56),
    (56, 100, 150, 250, 340, 500, 900, 1800),
    (2048, 1024, 512, 256, 128, 64, 32, 32),
], ids=["long-first", "long-last", "geometric"])
def test_the_slowest_rank_does_the_mean_attention_work(lengths):
    documents = packed(*lengths)
    split = document_split(documents, 4)
    assert sorted(split.flatten().tolist()) == list(range(4096))  # every position once, 1,024 a rank
    assert all(bool((row[1:] > row[:-1]).all()) for row in split)  # each rank's in window order
    work = attention_pairs(documents, split).double()
    causal = attention_pairs(documents, causal_split(4096, 4)).double()
    assert int(work.sum()) == int(causal.sum()) == sum(n * (n + 1) // 2 for n in lengths)
    assert float(work.max() / work.mean()) <= 1.15
    assert float(causal.max() / causal.mean()) > 1.4


def test_rows_are_weighed_together_and_equal_documents_keep_the_causal_balance():
    """A micro-batch's rows share one split (weighed by their summed work); a window of one document is the
    causal case, which the split balances as the causal split does."""
    rows = torch.stack([packed(1000, 24), packed(24, 1000)])
    split = document_split(rows, 2)
    work = attention_pairs(rows, split).double()
    assert float(work.max() / work.mean()) <= 1.01
    one = packed(1024)
    assert float(attention_pairs(one, document_split(one, 4)).double().max()
                 / attention_pairs(one, causal_split(1024, 4)).double().max()) <= 1.0 + 1e-3
    assert torch.equal(document_split(rows, 2), split)  # integers only: every rank computes the same


def test_a_window_the_split_cannot_cut_is_refused():
    with pytest.raises(Exception, match="divisible by 8"):
        document_split(packed(30), 4)


def test_a_micro_batch_carrying_its_split_still_counts_its_rows():
    """Under the document-aware split a micro-batch's positions are a Documents carrying the split: what counts a
    batch's rows (the Trainer's loss normalisation) reads its shape as the positions'."""
    from paratrain.hybrid.batches import batch_rows
    from paratrain.nn.documents import Documents, WindowSplit

    positions = packed(3, 5).expand(2, -1)
    split = WindowSplit(torch.arange(4), torch.arange(8).view(2, 4), (0, 3))
    assert batch_rows((positions, positions, Documents(positions, split))) == 2
    assert Documents.tensor(Documents(positions, split)) is positions and Documents.tensor(positions) is positions
