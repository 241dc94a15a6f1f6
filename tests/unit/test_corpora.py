"""Megatron corpora as they are (paratrain.data.corpora) and weighted mixtures in a layout-free order
(paratrain.data.mixture): split as megatron-core splits, drawn by weight, resumed exactly, refused by name."""

from __future__ import annotations

import hashlib
import math
import warnings

import numpy as np
import pytest

from paratrain.config import ConfigError
from paratrain.data.corpora import parse_split, prefix_parts, split_bounds
from paratrain.data.mixture import MixtureLoader, Source, WeightSchedule

SPLITS = ["969,30,1", "98,2,0", "90,5,5", "1,1,1", "99,1", "100", "0.7,0.2,0.1", "333,333,334"]


def _megatron():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": megatron-core on a CPU
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")


@pytest.mark.parametrize("split", SPLITS)
def test_the_split_is_megatron_core_s(split):
    """Part bounds equal megatron-core's: parse_and_normalize_split, its split matrix, and the builder's
    int(round(bookend x n)) (blended_megatron_dataset_builder), for corpus sizes 1 .. 2,000."""
    config = _megatron()
    matrix = config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split))
    for elements in [*range(1, 60), 97, 1000, 1999, 2000]:
        theirs = [(int(round(b[0] * float(elements))), int(round(b[1] * float(elements)))) if b else (0, 0)
                  for b in matrix]
        assert split_bounds(parse_split(split), elements) == theirs, (split, elements)


def test_a_corpus_megatron_core_wrote_is_read_by_part(tmp_path):
    """megatron-core's IndexedDatasetBuilder writes a corpus of several sequences per document (sentence
    splitting); each part paratrain reads is exactly the sequences megatron-core's reader gives for its bounds, and
    its document starts are the documents beginning there."""
    _megatron()
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for _ in range(40):
        for _ in range(int(rng.integers(1, 4))):  # sentences of a document
            builder.add_item(torch.from_numpy(rng.integers(0, 500, size=int(rng.integers(3, 12))).astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))
    theirs = IndexedDataset(str(tmp_path / "corpus"))
    parts = prefix_parts(str(tmp_path / "corpus"), "90,10,0")
    bounds = split_bounds(parse_split("90,10,0"), len(theirs))
    documents = set(theirs.document_indices[:-1].tolist())
    for name, (first, end) in zip(("train", "val"), bounds):
        tokens, starts = parts[name]
        assert np.array_equal(tokens, np.concatenate([theirs[i] for i in range(first, end)]))
        lengths = np.cumsum([0] + [len(theirs[i]) for i in range(first, end)])
        assert starts.tolist() == [int(lengths[i - first]) for i in range(first, end) if i in documents]


def test_bad_corpora_and_splits_are_refused_by_name(tmp_path):
    from paratrain.data import load_source, open_data
    from paratrain.data.indexed import IndexedWriter

    writer = IndexedWriter(tmp_path / "c", np.dtype(np.uint16))
    for d in range(10):
        writer.add(np.arange(d, d + 5))
    writer.close()
    source = load_source(str(tmp_path / "c"), split="80,20,0")  # `--data PREFIX --split 80,20,0`
    assert source.train.tolist() == [t for d in range(8) for t in range(d, d + 5)]
    assert source.val_documents.tolist() == [0, 5] and source.vocab_size == 14
    with pytest.raises(FileNotFoundError, match="drop --split"):
        load_source("builtin", split="98,2,0")
    with pytest.raises(FileNotFoundError, match="weight, source pairs"):
        open_data("builtin", path=(str(tmp_path / "c"),))
    with pytest.raises(FileNotFoundError, match="no mixture"):
        open_data("builtin", schedule="0:1")
    with pytest.raises(ConfigError, match="leaves the validation part"):
        prefix_parts(str(tmp_path / "c"), "100,0,0")
    with pytest.raises(ConfigError, match="leaves the training part"):
        prefix_parts(str(tmp_path / "c"), "0,1,0")
    (tmp_path / "c.idx").rename(tmp_path / "d.idx")
    with pytest.raises(ConfigError, match=r"lacks \['.*c.idx'\]"):
        prefix_parts(str(tmp_path / "c"), "98,2,0")
    for bad in ("a,b", "-1,2,0", "0,0,0", "1,2,3,4", "nan,1"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)


def _sources(sizes: tuple[int, ...] = (4000, 6000, 9000)) -> list[Source]:
    """Token streams whose ids name their source (source s holds ids s * 1000 + ...)."""
    return [Source(f"s{i}", (np.arange(n) % 997 + 1000 * i).astype(np.uint16)) for i, n in enumerate(sizes)]


def _global_batches(dp: int, steps: int, schedule: WeightSchedule, *, resume_at: int | None = None,
                    resume_dp: int | None = None) -> list[str]:
    """SHA-256 of every step's global batch (every dp rank's rows, in rank order), optionally saving the cursor at
    step `resume_at` and going on in a new loader of another dp degree from it."""
    def loaders(d: int) -> list[MixtureLoader]:
        return [MixtureLoader(_sources(), schedule, seq_len=8, global_batch=24, dp=d, dp_index=r, seed=7)
                for r in range(d)]

    ranks, out = loaders(dp), []
    for step in range(steps):
        if step == resume_at:
            state = ranks[0].state_dict()
            ranks = loaders(resume_dp or dp)
            for loader in ranks:
                loader.load_state_dict(state)
        rows = [loader.next() for loader in ranks]
        whole = np.concatenate([np.concatenate([r[0].numpy(), r[1].numpy()[:, -1:]], axis=1) for r in rows])
        out.append(hashlib.sha256(whole.tobytes()).hexdigest())
    return out


def test_each_global_batch_is_the_same_in_every_layout_and_after_a_resume():
    schedule = WeightSchedule.of([(0, (0.2, 0.3, 0.5))], 3)
    one = _global_batches(1, 60, schedule)
    for dp in (2, 4, 8):
        assert _global_batches(dp, 60, schedule) == one
    assert _global_batches(4, 60, schedule, resume_at=30, resume_dp=2) == one
    assert _global_batches(1, 60, schedule, resume_at=30, resume_dp=8) == one


def test_shares_follow_the_weights_and_an_anneal_changes_nothing_before_it():
    """3 sources over 200 steps: each source's share within 4 binomial sigmas of its weight; weights changed from
    step 100 on leave steps 0-99 bitwise as they were."""
    before = WeightSchedule.parse("0:0.2,0.3,0.5", 3)
    anneal = WeightSchedule.parse("0:2,3,5;100:6,3,1", 3)  # normalised: the same weights until step 100
    loader = MixtureLoader(_sources(), before, seq_len=8, global_batch=24, dp=1, dp_index=0, seed=7)
    counts = np.zeros(3)
    for _ in range(200):
        inputs = loader.next()[0]
        counts += np.bincount(inputs[:, 0].numpy() // 1000, minlength=3)
    n = 200 * 24
    for share, weight in zip(counts / n, (0.2, 0.3, 0.5)):
        assert abs(share - weight) <= 4 * math.sqrt(weight * (1 - weight) / n), (share, weight)
    assert loader.source_tokens() == {f"s{i}": int(c) * 8 for i, c in enumerate(counts)}
    plain, annealed = _global_batches(1, 130, before), _global_batches(1, 130, anneal)
    assert plain[:100] == annealed[:100] and plain[100:] != annealed[100:]


def test_a_resume_refuses_a_changed_source_and_weights_are_checked():
    schedule = WeightSchedule.of([(0, (1, 1))], 2)
    loader = MixtureLoader(_sources((4000, 6000)), schedule, seq_len=8, global_batch=24, dp=1, dp_index=0, seed=7)
    loader.next()
    state = loader.state_dict()
    changed = _sources((4000, 6001))
    other = MixtureLoader(changed, schedule, seq_len=8, global_batch=24, dp=1, dp_index=0, seed=7)
    with pytest.raises(ValueError, match="source 's1' changed since the checkpoint"):
        other.load_state_dict(state)
    for bad, rule in (("0:1,-1", ">= 0"), ("0:1,nan", "finite"), ("0:0,0", "sum to 0"), ("0:1", "one weight per"),
                      ("5:1,1", "starts at step 0"), ("0:1,1;9:1,2;4:2,1", "must increase"), ("0-1,1", "STEP:W1")):
        with pytest.raises(ConfigError, match=rule):
            WeightSchedule.parse(bad, 2)
