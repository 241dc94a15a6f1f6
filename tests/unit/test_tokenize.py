"""paratrain tokenize: real corpora to Megatron-layout token files with the `tokenizers` library, offline."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from paratrain.config import ConfigError
from paratrain.data import load_source
from paratrain.data.indexed import IndexedTokens, IndexedWriter
from paratrain.data.sources import builtin_text
from paratrain.data.tokenize import EOS_TRAINED, TrainBpe, check_tokenizer, tokenize_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """CPython's pydoc topics as 208 jsonl documents and one .txt document."""
    folder = tmp_path_factory.mktemp("corpus")
    documents = builtin_text().split("\n\n\n")
    with open(folder / "docs.jsonl", "w") as out:
        for text in documents:
            out.write(json.dumps({"text": text, "id": len(text)}) + "\n")
    (folder / "extra.txt").write_text("One more document, on its own.\n")
    return folder, len(documents) + 1


def test_the_same_bytes_for_one_and_two_workers(corpus, tmp_path):
    """A trained BPE, then the same corpus tokenized again with the folder it wrote and 2 worker processes:
    every file the same bytes; each document ends with the end-of-sequence id, every 20th is validation."""
    folder, documents = corpus
    inputs = [folder / "docs.jsonl", folder / "extra.txt"]
    one = tokenize_corpus(inputs, tmp_path / "one", tokenizer=TrainBpe(1000), val_fraction=0.05, progress=False)
    two = tokenize_corpus(inputs, tmp_path / "two", tokenizer=tmp_path / "one" / "tokenizer", workers=2,
                          val_fraction=0.05, progress=False)
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert one["tokenizer"] == two["tokenizer"] and one["dtype"] == "uint16"
    assert one["train"]["documents"] + one["val"]["documents"] == documents and one["val"]["documents"] == documents // 20
    train = IndexedTokens(tmp_path / "one" / "train")
    eos = one["tokenizer"]["eos_id"]
    assert all(train.document(d)[-1] == eos for d in range(train.documents))
    assert int((train.tokens == eos).sum()) == train.documents  # EOS only where a document ends
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "one" / "tokenizer" / "tokenizer.json"))
    assert tokenizer.decode(train.document(train.documents - 1)[:-1].tolist()) == "One more document, on its own.\n"
    assert tokenizer.token_to_id(EOS_TRAINED) == eos


def test_int32_ids_for_a_vocabulary_over_65535(tmp_path):
    """A word-level tokenizer of 70,000 entries: ids stored as int32, read back exactly; its folder's
    files copied byte for byte."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(69_999)} | {"</s>": 69_999}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    source = tmp_path / "tok"
    source.mkdir()
    tokenizer.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "a.txt").write_text("w1 w69998 w65536 w2")
    (tmp_path / "b.txt").write_text("w70000 w3")  # unknown -> w0
    record = tokenize_corpus([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "out", tokenizer=source,
                             val_fraction=0.5, progress=False)
    assert record["dtype"] == "int32" and record["tokenizer"]["vocab_size"] == 70_000
    assert IndexedTokens(tmp_path / "out" / "train").tokens.tolist() == [1, 69_998, 65_536, 2, 69_999]
    assert IndexedTokens(tmp_path / "out" / "val").tokens.tolist() == [0, 3, 69_999]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / "tokenizer" / name).read_bytes() == (source / name).read_bytes()
    data = load_source(str(tmp_path / "out"))
    assert data.vocab_size == 70_000 and data.train.dtype == np.int32 and data.tokenizer == record["tokenizer"]


def test_the_index_is_megatrons_layout(tmp_path):
    """The .idx bytes, field by field as Megatron-LM's MMapIndexedDataset writes them (magic, version 1, dtype
    code 8 = uint16, sequence and document counts, lengths int32, byte pointers int64, document indices int64),
    and an index of several sequences per document (Megatron's sentence splitting) read back by document."""
    writer = IndexedWriter(tmp_path / "a", np.dtype(np.uint16))
    writer.add(np.array([5, 6, 7]))
    writer.add(np.array([8, 9]))
    writer.close()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 2, 3)
                + np.array([3, 2], np.int32).tobytes() + np.array([0, 6], np.int64).tobytes()
                + np.array([0, 1, 2], np.int64).tobytes())
    assert (tmp_path / "a.idx").read_bytes() == expected
    assert (tmp_path / "a.bin").read_bytes() == np.array([5, 6, 7, 8, 9], np.uint16).tobytes()
    # three sequences, two documents: document 0 is sequences 0-1
    (tmp_path / "b.bin").write_bytes(np.array([1, 2, 3, 4, 5, 6], np.int32).tobytes())
    (tmp_path / "b.idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, 4) + struct.pack("<QQ", 3, 3)
        + np.array([2, 1, 3], np.int32).tobytes() + np.array([0, 8, 12], np.int64).tobytes()
        + np.array([0, 2, 3], np.int64).tobytes())
    read = IndexedTokens(tmp_path / "b")
    assert read.documents == 2 and read.document(0).tolist() == [1, 2, 3] and read.document(1).tolist() == [4, 5, 6]
    assert read.document_starts.tolist() == [0, 3]
    (tmp_path / "b.bin").write_bytes(np.array([1, 2], np.int32).tobytes())
    with pytest.raises(ValueError, match="cut short"):
        IndexedTokens(tmp_path / "b")


def test_another_tokenizer_and_bad_inputs_are_refused(corpus, tmp_path):
    folder, _ = corpus
    tokenize_corpus([folder / "extra.txt"] * 4, tmp_path / "a", tokenizer=TrainBpe(300), val_fraction=0.25,
                    progress=False)
    tokenize_corpus([folder / "docs.jsonl"], tmp_path / "b", tokenizer=TrainBpe(400), progress=False)
    check_tokenizer(tmp_path / "a", tmp_path / "a" / "tokenizer")
    with pytest.raises(ConfigError, match="written with another tokenizer"):
        check_tokenizer(tmp_path / "a", tmp_path / "b" / "tokenizer")
    with pytest.raises(ConfigError, match="exists"):
        tokenize_corpus([folder / "extra.txt"], tmp_path / "a", tokenizer=TrainBpe(300), progress=False)
    with pytest.raises(ConfigError, match="no text field 'body'.*--text-key"):
        tokenize_corpus([folder / "docs.jsonl"], tmp_path / "c", tokenizer=TrainBpe(300), text_key="body",
                        progress=False)
    with pytest.raises(ConfigError, match="none fell there"):
        tokenize_corpus([folder / "extra.txt"], tmp_path / "d", tokenizer=TrainBpe(300), val_fraction=0.1,
                        progress=False)
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()  # nothing half-written is published
    with pytest.raises(ConfigError, match="--train-bpe VOCAB must be at least 1, got 0"):
        tokenize_corpus([folder / "extra.txt"], tmp_path / "e", tokenizer=TrainBpe(0), progress=False)


def test_parquet_and_jsonl_give_the_same_tokens(corpus, tmp_path):
    """The same documents as a .parquet column and as .jsonl lines (`--text-key`): the same token files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, _ = corpus
    texts = [json.loads(line)["text"] for line in (folder / "docs.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"body": texts}), tmp_path / "docs.parquet")
    tokenize_corpus([folder / "docs.jsonl"], tmp_path / "j", tokenizer=TrainBpe(500), progress=False)
    tokenize_corpus([tmp_path / "docs.parquet"], tmp_path / "p", tokenizer=tmp_path / "j" / "tokenizer",
                    text_key="body", progress=False)
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "j" / name).read_bytes() == (tmp_path / "p" / name).read_bytes(), name


def test_chat_input_and_templates_are_checked(tmp_path):
    """--chat: a record without a conversation and a tokenizer without a chat template are refused by name; a
    template that renders a beginning differently when more follows is refused (the assistant's tokens would be
    undefined)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from paratrain.config import ConfigError
    from paratrain.data.chat import ChatEncoder, tokenize_chat

    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", "hi", "yes", "user",
                                                                        "assistant"])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ConfigError, match="has no chat template"):
        tokenize_chat([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer=folder)
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}" \
               "{% if add_generation_prompt %}assistant {% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: no conversation under 'messages'"):
        tokenize_chat([tmp_path / "bad.jsonl"], tmp_path / "out", tokenizer=folder)
    ids, mask = ChatEncoder(folder).encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
                                           "x")
    assert ids.tolist() == [4, 2, 5, 3, 1] and mask.tolist() == [0, 0, 0, 1, 1]
    odd = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": odd}))
    with pytest.raises(ConfigError, match="renders the conversation's beginning through message 2 differently"):
        ChatEncoder(folder).encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
                                    {"role": "user", "content": "hi"}], "x")
