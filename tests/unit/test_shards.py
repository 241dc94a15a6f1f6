"""Streaming sources (paratrain.data.shards): a folder of many shards read lazily as one corpus, in a keyed order that
needs O(1) memory (paratrain.data.permutation), with memory that does not grow with the corpus; text shards tokenized
shard by shard, the same bytes for any number of workers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from paratrain.config import ConfigError
from paratrain.data.corpora import prefix_parts
from paratrain.data.indexed import IndexedTokens, IndexedWriter
from paratrain.data.loader import GlobalBatchLoader
from paratrain.data.permutation import KeyedPermutation
from paratrain.data.shards import shard_parts
from paratrain.data.sources import load_source


def _megatron_shards(folder: Path, shards: int, seed: int = 0) -> list[list[np.ndarray]]:
    """`shards` corpora megatron-core's IndexedDatasetBuilder writes (several sequences per document), and the same
    documents as one prefix `folder.parent / "whole"`; returns each shard's sequences."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": megatron-core on a CPU
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    folder.mkdir()
    rng = np.random.default_rng(seed)
    whole = indexed.IndexedDatasetBuilder(str(folder.parent / "whole.bin"), dtype=np.uint16)
    written = []
    for n in range(shards):
        builder = indexed.IndexedDatasetBuilder(str(folder / f"part_{n:05d}.bin"), dtype=np.uint16)
        sequences = []
        for _ in range(int(rng.integers(1, 6))):
            for _ in range(int(rng.integers(1, 4))):  # sentences of a document
                ids = rng.integers(0, 500, size=int(rng.integers(2, 15))).astype(np.int64)
                for target in (builder, whole):
                    target.add_item(torch.from_numpy(ids))
                sequences.append(ids)
            builder.end_document()
            whole.end_document()
        builder.finalize(str(folder / f"part_{n:05d}.idx"))
        written.append(sequences)
    whole.finalize(str(folder.parent / "whole.idx"))
    return written


def test_shards_are_read_as_one_prefix_and_windows_cross_them(tmp_path):
    """50 shards megatron-core wrote read as the one prefix holding the same documents: each part of --split 90,10,0
    is that prefix's part token for token, with the same document starts (read lazily from the shards' indexes); the
    windows a loader reads (inputs, targets, document positions) equal those of the arrays, across shard ends."""
    _megatron_shards(tmp_path / "shards", 50)
    parts = shard_parts(str(tmp_path / "shards"), "90,10,0")
    whole = prefix_parts(str(tmp_path / "whole"), "90,10,0")
    for name in ("train", "val"):
        tokens, starts = whole[name]
        view = parts[name]
        assert len(view) == len(tokens) and np.array_equal(view[0: len(view)], tokens)
        assert np.array_equal(view.documents.between(0, len(view)), starts)
        assert np.array_equal(view[5:9], tokens[5:9]) and np.array_equal(view[len(view) - 3:], tokens[-3:])
    tokens, starts = whole["train"]
    for seq_len in (7, 16):
        lazy = GlobalBatchLoader(parts["train"], seq_len=seq_len, global_batch=8, dp=1, dp_index=0, seed=3,
                                 document_starts=parts["train"].documents, order="keyed")
        dense = GlobalBatchLoader(tokens, seq_len=seq_len, global_batch=8, dp=1, dp_index=0, seed=3,
                                  document_starts=starts)
        for _ in range(lazy.batches_per_epoch):
            indices = lazy.next_indices()
            for mine, theirs in zip(lazy.gather(indices), dense.gather(indices)):
                assert torch_equal(mine, theirs)
    source = load_source(str(tmp_path / "shards"), split="90,10,0")
    assert source.order == "keyed" and source.vocab_size == int(tokens.max()) + 1


def torch_equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 65, 1000, 4097])
def test_the_keyed_permutation_visits_every_sample_once(n):
    """A Feistel network with cycle walking is a bijection on [0, n), for n on either side of powers of two; the seed
    and the key change it, and position p needs no other position (a slice equals the whole's slice)."""
    order = KeyedPermutation(n, seed=0, key="data/epoch0")
    everything = order.at(np.arange(n))
    assert sorted(everything.tolist()) == list(range(n))
    assert np.array_equal(order.at(np.arange(n // 2, n)), everything[n // 2:])
    if n >= 17:
        assert not np.array_equal(everything, KeyedPermutation(n, seed=1, key="data/epoch0").at(np.arange(n)))
        assert not np.array_equal(everything, KeyedPermutation(n, seed=0, key="data/epoch1").at(np.arange(n)))
        assert not np.array_equal(everything, np.arange(n))


def _batch_hashes(tokens, starts, *, dp: int, steps: int, resume_at: int | None = None,
                  resume_dp: int = 1) -> list[str]:  # type: ignore[no-untyped-def]
    """The SHA-256 of every global batch (every dp rank's rows, in rank order) of a keyed-order loader; resumed from
    the state after `resume_at` steps under dp `resume_dp`."""
    def ranks(degree: int) -> list[GlobalBatchLoader]:
        return [GlobalBatchLoader(tokens, seq_len=16, global_batch=8, dp=degree, dp_index=r, seed=5,
                                  document_starts=starts, order="keyed") for r in range(degree)]

    loaders, hashes = ranks(dp), []
    for step in range(steps):
        if step == resume_at:
            state = loaders[0].state_dict()
            loaders = ranks(resume_dp)
            for loader in loaders:
                loader.load_state_dict(state)
        rows = [loader.next() for loader in loaders]
        digest = hashlib.sha256()
        for part in zip(*rows):
            for tensor in part:
                digest.update(tensor.numpy().tobytes())
        hashes.append(digest.hexdigest())
    return hashes


def test_every_global_batch_is_the_same_for_any_dp_and_after_a_resume(tmp_path):
    """A shard folder's global batches (tokens, targets and document positions) hash the same for dp 1, 2 and 4, over
    more than an epoch, and after a resume at step 5 on another dp degree; a checkpoint of a dense order is refused
    by a keyed one (the same samples would not follow)."""
    _megatron_shards(tmp_path / "shards", 12)
    train = shard_parts(str(tmp_path / "shards"), "95,5,0")["train"]
    steps = 2 * (len(train) - 1) // 16 // 8 + 1
    one = _batch_hashes(train, train.documents, dp=1, steps=steps)
    assert len(set(one)) == len(one)
    assert _batch_hashes(train, train.documents, dp=2, steps=steps) == one
    assert _batch_hashes(train, train.documents, dp=4, steps=steps) == one
    assert _batch_hashes(train, train.documents, dp=4, steps=steps, resume_at=5, resume_dp=2) == one
    dense = GlobalBatchLoader(np.zeros(1000, np.uint16), seq_len=16, global_batch=8, dp=1, dp_index=0, seed=5)
    keyed = GlobalBatchLoader(train, seq_len=16, global_batch=8, dp=1, dp_index=0, seed=5, order="keyed")
    with pytest.raises(ValueError, match="order=dense, this run order=keyed"):
        keyed.load_state_dict(dense.state_dict())


MEASURE = """
import sys, tracemalloc
from paratrain.data.sources import load_source
from paratrain.data.loader import GlobalBatchLoader

def resident():  # KiB of anonymous and file-backed resident pages now (Linux)
    fields = dict(line.split(":") for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssFile"))

before = resident()
tracemalloc.start()
source = load_source(sys.argv[1], split="98,2,0")
loader = GlobalBatchLoader(source.train, seq_len=256, global_batch=16, dp=1, dp_index=0, seed=0,
                           document_starts=source.train_documents, order=source.order)
for _ in range(20):
    loader.next()
peak = tracemalloc.get_traced_memory()[1]
print(peak, resident() - before, len(source.train))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads resident memory from /proc (Linux)")
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Two folders of 50 shards, 1.9 Mi and 19 Mi tokens (3.7 and 37 MB of uint16): opening one (its vocabulary
    scanned, its split found), then reading 20 batches of 16 x 257 tokens with document positions, costs the same
    memory. Measured (AMD EPYC, fresh processes): Python and numpy allocations peak at 0.30 and 0.31 MB; resident
    memory grows by 5.5 and 5.9 MB (the pages touched, and what the first import of each module allocates)."""
    def folder(name: str, tokens_per_shard: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        rng = np.random.default_rng(0)
        for n in range(50):
            writer = IndexedWriter(path / f"shard_{n:03d}", np.uint16)
            lengths = rng.integers(200, 1800, size=tokens_per_shard // 1000)
            block = rng.integers(0, 32000, size=int(lengths.sum()), dtype=np.uint16)
            for piece in np.split(block, np.cumsum(lengths)[:-1]):
                writer.add(piece)
            writer.close()
        return path

    measured = {}
    for name, size in (("small", 40_000), ("large", 400_000)):
        out = subprocess.run([sys.executable, "-c", MEASURE, str(folder(name, size))], capture_output=True, text=True,
                             check=True)
        traced, rss_kb, tokens = (int(v) for v in out.stdout.split())
        measured[name] = (traced, rss_kb, tokens)
        print(f"\n{name}: {tokens / 2**20:.1f} Mi tokens, traced peak {traced / 1e6:.2f} MB, "
              f"RSS +{rss_kb / 1e3:.1f} MB")
    (small_traced, small_rss, small_tokens), (large_traced, large_rss, large_tokens) = (measured["small"],
                                                                                      measured["large"])
    assert large_tokens > 9 * small_tokens
    assert large_traced < 1.25 * small_traced + 200_000  # bytes
    assert large_rss < small_rss + 16_000  # KiB: reading the large corpus whole would add 37 MB


def _bpe_folder(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer folder (tokenizer.json and its end-of-sequence token)."""
    from paratrain.data.tokenize import EOS_TRAINED, train_bpe

    text = tmp_path / "bpe.txt"
    text.write_text(" ".join(f"word{i % 97} and more text {i}" for i in range(2000)))
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    train_bpe([text], 400).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TRAINED}))
    return folder


def test_text_shards_are_the_same_bytes_for_one_and_four_workers(tmp_path):
    """50 text shards (.jsonl, and a .parquet among them) tokenized shard by shard by 1 and by 4 worker processes:
    the same bytes, each shard's documents those the tokenizer gives one by one; a second call reads the cache; the
    folder reads as a streaming source whose tokens.json names the tokenizer."""
    from tokenizers import Tokenizer

    from paratrain.data.text import tokenized_shards

    tokenizer = _bpe_folder(tmp_path)
    shards = tmp_path / "web"
    shards.mkdir()
    documents = {}
    for n in range(50):
        texts = [f"shard {n} document {d}: " + " ".join(f"word{(n * d + k) % 97}" for k in range(d + 3))
                 for d in range(1 + n % 4)]
        documents[f"part-{n:03d}"] = texts
        if n == 7:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts}), shards / f"part-{n:03d}.parquet")
        else:
            (shards / f"part-{n:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    one, cached = tokenized_shards(str(shards), str(tokenizer), workers=1, cache=str(tmp_path / "cache1"))
    four, _ = tokenized_shards(str(shards), str(tokenizer), workers=4, cache=str(tmp_path / "cache4"))
    assert not cached and tokenized_shards(str(shards), str(tokenizer), cache=str(tmp_path / "cache1")) == (one, True)
    names = sorted(p.name for p in one.iterdir() if p.suffix in (".bin", ".idx"))
    assert len(names) == 100 and names == sorted(p.name for p in four.iterdir() if p.suffix in (".bin", ".idx"))
    for name in names:
        assert (one / name).read_bytes() == (four / name).read_bytes(), name
    bpe = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = bpe.token_to_id("<|endoftext|>")
    for stem, texts in documents.items():
        shard = IndexedTokens(one / stem)
        assert [shard.document(d).tolist() for d in range(shard.documents)] == [
            bpe.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
    source = load_source(str(one), split="90,10,0")
    assert source.tokenizer is not None and source.tokenizer["eos_id"] == eos and source.order == "keyed"


def test_bad_shard_folders_are_refused_by_name(tmp_path):
    """Text shards without --hf, token and text shards in one folder, a shard missing its .bin, and a split that
    leaves the validation part empty are refused with the fix."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ConfigError, match="give --hf DIR"):
        load_source(str(folder))
    writer = IndexedWriter(folder / "b", np.uint16)
    writer.add(np.arange(50))
    writer.close()
    with pytest.raises(ConfigError, match="keep one kind per folder"):
        load_source(str(folder))
    (folder / "a.jsonl").unlink()
    with pytest.raises(ConfigError, match="leaves the validation part"):
        load_source(str(folder), split="100,0,0")
    (folder / "b.bin").unlink()
    with pytest.raises(ConfigError, match="has an .idx and no .bin"):
        load_source(str(folder))


def test_a_shard_folder_in_a_mixture_reads_the_same_batches_in_every_layout(tmp_path):
    """A shard folder beside an array in `--data-path`: each global batch hashes the same for dp 1 and dp 4; the
    checkpoint names the folder by its shards (a changed shard refused when resuming)."""
    import torch

    from paratrain.data.mixture import MixtureLoader, Source, WeightSchedule

    _megatron_shards(tmp_path / "shards", 10)
    train = shard_parts(str(tmp_path / "shards"), "95,5,0")["train"]
    other = np.random.default_rng(1).integers(0, 500, size=3000).astype(np.uint16)
    schedule = WeightSchedule.of([(0, [0.5, 0.5])], 2)

    def loaders(dp: int) -> list[MixtureLoader]:
        sources = [Source("shards", train, train.documents, order="keyed"),
                   Source("array", other, np.arange(0, 3000, 100))]
        return [MixtureLoader(sources, schedule, seq_len=16, global_batch=8, dp=dp, dp_index=r, seed=2)
                for r in range(dp)]

    hashes = {}
    for dp in (1, 4):
        ranks, hashes[dp] = loaders(dp), []
        for _ in range(12):
            rows = [loader.next() for loader in ranks]
            hashes[dp].append(hashlib.sha256(b"".join(torch.cat(part).numpy().tobytes() for part in zip(*rows)))
                              .hexdigest())
    assert hashes[1] == hashes[4]
    state = ranks[0].state_dict()
    assert state["sources"][0]["shards"] == 10
    (tmp_path / "shards" / "part_00000.bin").write_bytes(b"\x07\x00" + (tmp_path / "shards" / "part_00000.bin")
                                                         .read_bytes()[2:])
    fresh = shard_parts(str(tmp_path / "shards"), "95,5,0")["train"]
    changed = MixtureLoader([Source("shards", fresh, order="keyed"), Source("array", other)], schedule, seq_len=16,
                            global_batch=8, dp=1, dp_index=0, seed=2)
    with pytest.raises(ValueError, match="changed since the checkpoint"):
        changed.load_state_dict(state)
