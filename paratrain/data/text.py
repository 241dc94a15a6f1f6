"""Text given to a Hugging Face model: tokenized by the model's own tokenizer, once, and cached.

A model loaded with `--hf DIR` reads the ids of DIR's tokenizer. Reading a text file as UTF-8 bytes (ids 0-255)
is the byte-level GPT's way, and for an HF model it trains on ids that mean nothing to it, with no error: every
id fits its vocabulary. So with --hf a text source is tokenized here, in the launching process, before any worker
starts, into the layout `paratrain tokenize` writes (Megatron's .bin/.idx with a document index, tokens.json naming
the tokenizer), and the run reads that folder:

    builtin          CPython's pydoc topics, one document per topic (paratrain.data.sources.builtin_text's order)
    .jsonl / .json   one document per line (its "text" field), as `paratrain tokenize` reads them
    .parquet         one document per row of the "text" column
    .txt / .md       one document; its token stream's tail (val_fraction of it) held out for validation, as
                     the byte-level reading holds out the tail of the bytes

A folder of text shards (.jsonl / .parquet; paratrain.data.shards) is tokenized shard by shard (tokenized_shards):
each shard on its own into PREFIX.bin / PREFIX.idx of the same name, by `workers` processes, so the tokens are the same
for any number of them and a worker holds one chunk of one shard at a time; the run reads the folder of indexed
shards lazily and splits it by --split.

Documents go to the validation split as `paratrain tokenize` sends them (every 1/f-th, by index alone), so
`--data corpus.jsonl` and `--data $(paratrain tokenize corpus.jsonl --tokenizer DIR --val-fraction f)` give
the same tokens. The folder lives under the cache (data.cache, else $XDG_CACHE_HOME/paratrain or
~/.cache/paratrain), named by the SHA-256 of the text, of the tokenizer's tokenizer.json and of the split: a
changed file or tokenizer makes a new folder, and a second run with the same inputs reads the first's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from paratrain.config.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".jsonl", ".json", ".parquet")
ONE_DOCUMENT = (".txt", ".md", ".text")


def is_text(source: str) -> bool:
    """Whether a data source string names text (to tokenize) rather than token files."""
    return source == "builtin" or (Path(source).is_file() and Path(source).suffix.lower() in TEXT_SUFFIXES)


def cache_root(configured: str = "") -> Path:
    """Where tokenized text is kept: `configured`, else $XDG_CACHE_HOME/paratrain/tokens (~/.cache by default)."""
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paratrain" / "tokens"


def tokenized(source: str, model_dir: str, *, val_fraction: float, cache: str = "") -> tuple[Path, bool]:
    """(the folder of `source` tokenized by `model_dir`'s tokenizer, whether it was already cached)."""
    from paratrain.data.tokenize import load_tokenizer

    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ConfigError(f"--hf {model_dir} has no tokenizer.json, so the text {source!r} cannot be read as the "
                          f"model's tokens: save the model's tokenizer into {model_dir} (tokenizer.save_pretrained), "
                          "or give token files written with it (`paratrain tokenize --tokenizer TOKENIZER_DIR`)")
    load_tokenizer(model_dir)  # refuses a tokenizer without an end-of-sequence token now, naming the fix
    digest = hashlib.sha256()
    for part in (_text_bytes(source), tokenizer_json.read_bytes(), f"val_fraction={val_fraction!r}".encode()):
        digest.update(hashlib.sha256(part).digest())
    name = "builtin" if source == "builtin" else Path(source).name
    return _published(cache_root(cache) / f"{name}-{digest.hexdigest()[:16]}",
                      lambda staging, scratch: _write(source, model_dir, staging, scratch, val_fraction))


def _published(folder: Path, write: Callable[[Path, Path], None]) -> tuple[Path, bool]:
    """(folder, True) when the cache holds it (its tokens.json written last); else write(staging, scratch) fills a
    temporary folder beside it, published at once by a rename: (folder, False)."""
    if (folder / "tokens.json").is_file():
        return folder, True
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tokens-", dir=folder.parent) as scratch:
        staging = Path(scratch) / "out"
        write(staging, Path(scratch))
        try:
            staging.rename(folder)
        except OSError:  # another process of the job published the same folder first: the same bytes
            if not (folder / "tokens.json").is_file():
                raise
    return folder, False


def _text_bytes(source: str) -> bytes:
    if source == "builtin":
        from paratrain.data.sources import builtin_text

        return builtin_text().encode("utf-8")
    return Path(source).read_bytes()


def _write(source: str, model_dir: str, out: Path, scratch: Path, val_fraction: float) -> None:
    from paratrain.data.tokenize import tokenize_corpus

    if source == "builtin":  # one document per topic, as a .jsonl `paratrain tokenize` reads
        from pydoc_data.topics import topics

        lines = scratch / "builtin.jsonl"
        lines.write_text("".join(json.dumps({"text": topics[key]}) + "\n" for key in sorted(topics)))
        tokenize_corpus([lines], out, tokenizer=model_dir, val_fraction=val_fraction, progress=False)
    elif Path(source).suffix.lower() in ONE_DOCUMENT:
        tokenize_corpus([source], out, tokenizer=model_dir, val_fraction=0.0, progress=False)
        _split_tail(out, val_fraction)
    else:
        tokenize_corpus([source], out, tokenizer=model_dir, val_fraction=val_fraction, progress=False)


def _split_tail(folder: Path, val_fraction: float) -> None:
    """One document in `folder`'s train split: its last val_fraction of tokens become the validation split."""
    from paratrain.data.indexed import IndexedTokens, IndexedWriter

    record = json.loads((folder / "tokens.json").read_text())
    tokens = np.array(IndexedTokens(folder / "train").tokens)
    cut = int(len(tokens) * (1.0 - val_fraction))
    for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
        writer = IndexedWriter(folder / split, tokens.dtype)
        writer.add(part)
        writer.close()
        record[split] = {"documents": 1, "tokens": int(part.size)}
    record["val_fraction"], record["split"] = val_fraction, "the one document's tail"
    (folder / "tokens.json").write_text(json.dumps(record, indent=1))


def tokenized_shards(folder: str, model_dir: str, *, workers: int = 1, cache: str = "") -> tuple[Path, bool]:
    """(the folder of text shards `folder` tokenized by `model_dir`'s tokenizer, shard by shard, whether it was
    already cached): NAME.jsonl becomes NAME.bin / NAME.idx, with tokens.json and the tokenizer beside them."""
    import multiprocessing
    import shutil

    from paratrain.data.shards import file_digest, text_shards
    from paratrain.data.tokenize import TOKENIZER_FILES, load_tokenizer, tokenizer_identity

    files = text_shards(Path(folder))
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"--hf {model_dir} has no tokenizer.json, so the text shards in {folder!r} cannot be read as "
                          f"the model's tokens: save the model's tokenizer into {model_dir} (tokenizer.save_pretrained)")
    model, eos = load_tokenizer(model_dir)
    stems = [f.stem for f in files]
    if len(set(stems)) != len(stems):
        raise ConfigError(f"the text shards in {folder!r} repeat a name across suffixes ({sorted(stems)[:6]}...): "
                          "each shard becomes NAME.bin / NAME.idx, so give them distinct names")
    digest = hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes())
    for file in files:
        digest.update(file.name.encode() + b"\0" + file_digest(file))

    def write(staging: Path, scratch: Path) -> None:
        (staging / "tokenizer").mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (Path(model_dir) / name).is_file():
                shutil.copyfile(Path(model_dir) / name, staging / "tokenizer" / name)
        identity = tokenizer_identity(staging / "tokenizer", eos, model.get_vocab_size(with_added_tokens=True),
                                      model.token_to_id(eos))
        tasks = [(str(f), str(staging / f.stem), model_dir, identity["vocab_size"], identity["eos_id"]) for f in files]
        if workers > 1:
            with multiprocessing.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
                counts = pool.map(_tokenize_shard, tasks, chunksize=1)
        else:
            counts = [_tokenize_shard(task) for task in tasks]
        record = {"format": "megatron-indexed-shards", "tokenizer": identity, "inputs": [f.name for f in files],
                  "documents": sum(c[0] for c in counts), "tokens": sum(c[1] for c in counts)}
        (staging / "tokens.json").write_text(json.dumps(record, indent=1))

    return _published(cache_root(cache) / f"{Path(folder).resolve().name}-shards-{digest.hexdigest()[:16]}", write)


def _tokenize_shard(task: tuple[str, str, str, int, int]) -> tuple[int, int]:
    """One text shard to PREFIX.bin / .idx (each document's ids and the end-of-sequence id), a chunk of documents at
    a time; (documents, tokens) written."""
    from tokenizers import Tokenizer

    from paratrain.data.indexed import IndexedWriter, token_dtype
    from paratrain.data.tokenize import CHUNK, read_documents

    source, prefix, model_dir, vocab, eos = task
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    writer = IndexedWriter(prefix, token_dtype(vocab))
    chunk: list[str] = []

    def flush() -> None:
        for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
            writer.add(np.asarray([*encoding.ids, eos], dtype=np.int64))
        chunk.clear()

    for text in read_documents([source]):
        chunk.append(text)
        if len(chunk) == CHUNK:
            flush()
    flush()
    writer.close()
    return len(writer.lengths), int(sum(writer.lengths))

