from __future__ import annotations

import numpy as np
import pytest
import torch

from paratrain.data import GlobalBatchLoader, builtin_text, load_source, write_token_file


def _loader(tokens, dp, index, global_batch=8, seq_len=4, seed=3):
    return GlobalBatchLoader(tokens, seq_len=seq_len, global_batch=global_batch, dp=dp, dp_index=index, seed=seed)


def test_builtin_corpus_is_english_and_split():
    text = builtin_text()
    assert len(text) > 300_000 and "the" in text
    source = load_source("builtin")
    assert source.vocab_size == 256
    assert len(source.val) / (len(source.train) + len(source.val)) == pytest.approx(0.1, abs=1e-3)


def test_global_order_does_not_depend_on_dp():
    tokens = np.arange(1000, dtype=np.uint16)
    reference = _loader(tokens, 1, 0)
    batches = [reference.next()[0] for _ in range(40)]  # 249 samples: 31 batches per epoch
    for dp in (2, 4):
        loaders = [_loader(tokens, dp, r) for r in range(dp)]
        for step in range(40):
            parts = torch.cat([loader.next()[0] for loader in loaders])
            assert torch.equal(parts, batches[step])


def test_samples_are_shifted_windows():
    tokens = np.arange(100, dtype=np.uint16)
    loader = _loader(tokens, 1, 0, global_batch=2, seq_len=5)
    x, y = loader.next()
    assert x.dtype == torch.int64 and x.shape == (2, 5)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert int(x[0, 0]) == loader.last_indices[0] * 5


def test_epoch_visits_each_sample_once_and_reshuffles():
    tokens = np.arange(401, dtype=np.uint16)  # 100 samples of 4+1 tokens
    loader = _loader(tokens, 1, 0, global_batch=10)
    epoch0 = [i for _ in range(10) for i in (loader.next(), loader.last_indices)[1]]
    assert sorted(epoch0) == list(range(100))
    epoch1 = [i for _ in range(10) for i in (loader.next(), loader.last_indices)[1]]
    assert sorted(epoch1) == list(range(100)) and epoch1 != epoch0


def test_state_round_trip_reads_the_same_batches():
    tokens = np.arange(1000, dtype=np.uint16)
    a = _loader(tokens, 2, 1)
    for _ in range(5):
        a.next()
    state = a.state_dict()
    expected = [a.next()[0] for _ in range(30)]
    b = _loader(tokens, 2, 1)
    b.load_state_dict(state)
    assert all(torch.equal(b.next()[0], e) for e in expected)
    with pytest.raises(ValueError, match="global_batch"):
        _loader(tokens, 2, 1, global_batch=4).load_state_dict(state)


def test_too_little_data():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _loader(np.arange(20, dtype=np.uint16), 1, 0, global_batch=8)


def test_token_folder_and_text_file(tmp_path):
    write_token_file(tmp_path / "train.bin", np.arange(5000) % 1000)
    write_token_file(tmp_path / "val.bin", np.arange(600) % 700)
    source = load_source(str(tmp_path))
    assert isinstance(source.train, np.memmap) and source.vocab_size == 1000
    assert int(source.train[1234]) == 234
    text = tmp_path / "t.txt"
    text.write_text("héllo world " * 100)
    source = load_source(str(text), val_fraction=0.25)
    assert source.vocab_size == 256 and len(source.val) == pytest.approx(len("héllo world ".encode()) * 25, abs=2)
    assert source.decode(source.encode_text("héllo")) == "héllo"
    with pytest.raises(FileNotFoundError, match="neither 'builtin'"):
        load_source(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="lacks"):
        load_source(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_token_file(tmp_path / "x.bin", np.array([70000]))


def test_batch_rampup_reads_the_same_samples_in_growing_steps():
    """Megatron's rule (START 4, INCREMENT 4 over 16 samples to 16: 3 increments, one every 16/3 samples): batches
    of 4, 4, 8, 16, 16, ...; their samples, concatenated, are the fixed-batch run's in the same order; any dp reads
    the same global batches; a resume mid-ramp goes on exactly; the rules refuse with the reason."""
    from paratrain.config.plan import BatchRampup

    tokens = np.arange(2000, dtype=np.int64)
    ramp = BatchRampup.parse("4,4,16", 16)
    assert [ramp.batch_at(n) for n in (0, 4, 8, 16, 100)] == [4, 4, 8, 16, 16] and ramp.sizes() == [4, 8, 12, 16]

    def steps(dp: int, n: int, loader: GlobalBatchLoader | None = None) -> list[list[int]]:
        loaders = [loader] if loader else [GlobalBatchLoader(tokens, seq_len=8, global_batch=16, dp=dp, dp_index=r,
                                                             seed=3, rampup=ramp) for r in range(dp)]
        out = []
        for _ in range(n):
            out.append([i for ld in loaders for i in ld.next_indices()])
        return out

    ramped = steps(1, 6)
    assert [len(b) for b in ramped] == [4, 4, 8, 16, 16, 16]
    fixed = GlobalBatchLoader(tokens, seq_len=8, global_batch=4, dp=1, dp_index=0, seed=3)
    assert sum(ramped, []) == sum((fixed.next_indices() for _ in range(16)), [])
    assert steps(4, 6) == ramped
    first = GlobalBatchLoader(tokens, seq_len=8, global_batch=16, dp=1, dp_index=0, seed=3, rampup=ramp)
    steps(1, 3, first)
    resumed = GlobalBatchLoader(tokens, seq_len=8, global_batch=16, dp=1, dp_index=0, seed=3, rampup=ramp)
    resumed.load_state_dict(first.state_dict())
    assert steps(1, 3, resumed) == ramped[3:] and resumed.log_fields() == {"global_batch": 16}
    plain = GlobalBatchLoader(tokens, seq_len=8, global_batch=16, dp=1, dp_index=0, seed=3)
    with pytest.raises(ValueError, match="must keep the ramp-up"):
        plain.load_state_dict(first.state_dict())
    for text, rule in (("4,4", "three integers"), ("0,4,16", "must be >= 1"), ("4,5,16", "whole number of INCREMENT"),
                       ("16,4,16", "START .* below it")):
        with pytest.raises(ValueError, match=rule):
            BatchRampup.parse(text, 16)


def test_a_stream_is_read_in_its_own_order_whatever_dp_and_resumes():
    """StreamLoader: global batch k is items [kG, (k+1)G) for any dp, an epoch's tail skipped, the next pass read
    again; its state (items consumed) resumes exactly when the stream repeats itself; a stream shorter than a
    global batch is refused by name."""
    from paratrain.data.stream import StreamLoader

    stream = range(22)
    class Items:
        def __iter__(self):
            return iter(stream)

    def global_batches(dp: int, n: int) -> list[list[int]]:
        ranks = [StreamLoader(Items(), global_batch=8, dp=dp, dp_index=r) for r in range(dp)]
        return [sum((ld.next().tolist() for ld in ranks), []) for _ in range(n)]

    batches = global_batches(1, 4)
    assert batches == [list(range(8)), list(range(8, 16)), list(range(8)), list(range(8, 16))]  # tail 16-21 skipped
    assert global_batches(4, 4) == batches
    first = StreamLoader(Items(), global_batch=8, dp=1, dp_index=0)
    first.next(), first.next(), first.next()
    again = StreamLoader(Items(), global_batch=8, dp=1, dp_index=0)
    again.load_state_dict(first.state_dict())
    assert again.next().tolist() == batches[3] and again.batches_per_epoch == 2
    with pytest.raises(ValueError, match="yields 22 items in a pass, fewer than one global batch \\(32\\)"):
        StreamLoader(Items(), global_batch=32, dp=1, dp_index=0).next()


def test_sequence_warmup_cuts_the_same_samples_into_shorter_sequences():
    """--seq-warmup 8,6 at seq_len 32: sequences of 8, 8, 16, 16, 32, 32 tokens over the first 6 steps, then 32; a
    step's rows are its samples cut in pieces (the same inputs and targets in order; positions restart in each
    piece under documents); the rules refuse with the reason."""
    from paratrain.config.plan import SeqWarmup

    warm = SeqWarmup.parse("8,6", 32)
    assert [warm.length_at(s) for s in range(8)] == [8, 8, 16, 16, 32, 32, 32, 32] and warm.lengths() == [8, 16, 32]
    tokens = np.arange(3000, dtype=np.int64)
    documents = np.arange(0, 3000, 20, dtype=np.int64)
    plain = GlobalBatchLoader(tokens, seq_len=32, global_batch=4, dp=1, dp_index=0, seed=5, document_starts=documents)
    cut = GlobalBatchLoader(tokens, seq_len=32, global_batch=4, dp=1, dp_index=0, seed=5, document_starts=documents,
                            warmup=warm)
    for step in range(7):
        whole, pieces = plain.next(), cut.next()
        length = warm.length_at(step)
        assert pieces[0].shape == (4 * 32 // length, length)
        assert torch.equal(pieces[0].reshape(4, 32), whole[0]) and torch.equal(pieces[1].reshape(4, 32), whole[1])
        assert (pieces[2][:, 0] <= whole[2].reshape(-1, length)[:, 0]).all()  # positions restart in each piece
    for text, rule in (("8", "two integers"), ("12,6", "power of two"), ("32,6", "START below it"),
                       ("1,6", "START must be >= 2")):
        with pytest.raises(ValueError, match=rule):
            SeqWarmup.parse(text, 32)
