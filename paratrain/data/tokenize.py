"""`paratrain tokenize`: real corpora to token files, offline, with the `tokenizers` library.

    paratrain tokenize books/*.txt --tokenizer ./llama-tokenizer --out data/
    paratrain tokenize web.jsonl --text-key text --train-bpe 32000 --out data/ --workers 4

Inputs: .txt / .md files (one document each), .jsonl files (one document per line, its `text_key`
field), .parquet files (the `text_key` column; needs pyarrow). The tokenizer: a local Hugging Face
tokenizer folder (its tokenizer.json; the end-of-sequence token from tokenizer_config.json or
special_tokens_map.json, or --eos-token), or a byte-level BPE of `train_bpe` entries trained here on the
inputs (its end-of-sequence token <|endoftext|>).

Each document is encoded without special tokens and ends with the end-of-sequence id (so packed windows
see where documents end). Documents go to the validation split by their index alone (every 1/f-th with
--val-fraction f), and worker processes encode chunks of documents handed out and collected in order,
so the output is the same bytes for any number of workers. Written, and published at once (a temporary
folder renamed to OUT, which must not exist):

    OUT/train.bin, train.idx    Megatron's indexed layout (paratrain.data.indexed): uint16 ids when the
    OUT/val.bin, val.idx        vocabulary has <= 65,535 entries, else int32
    OUT/tokenizer/              the tokenizer's files, byte for byte (a trained one: tokenizer.json and a
                                tokenizer_config.json naming its end-of-sequence token)
    OUT/tokens.json             the tokenizer's identity (the SHA-256 of its tokenizer.json, vocabulary size,
                                end-of-sequence id), the dtype, counts per split, the inputs

load_source(OUT) reads it (paratrain.data.sources), and check_tokenizer refuses data written with
another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from paratrain.config.errors import ConfigError
from paratrain.data.indexed import IndexedWriter, token_dtype

EOS_TRAINED = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
"""Files of a tokenizer folder copied into OUT/tokenizer when present."""
CHUNK = 64
"""Documents per task handed to a worker."""


def read_documents(files: Sequence[str | Path], text_key: str = "text") -> Iterator[str]:
    """Every document's text, file by file in the order given."""
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"input {str(path)!r} is not a file")
        suffix = path.suffix.lower()
        if suffix in (".txt", ".md", ".text"):
            yield path.read_text(encoding="utf-8")
        elif suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield _field(json.loads(line), text_key, f"{path}:{number}")
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as error:
                raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from error
            table = pq.ParquetFile(path)
            if text_key not in table.schema_arrow.names:
                raise ConfigError(f"{path} has no column {text_key!r} (its columns: {table.schema_arrow.names}): "
                                  "name the text column with --text-key")
            for batch in table.iter_batches(batch_size=1024, columns=[text_key]):  # a batch in memory at a time
                yield from (str(text) for text in batch.column(0).to_pylist())
        else:
            raise ConfigError(f"input {str(path)!r}: paratrain tokenize reads .txt/.md (a document each), .jsonl "
                              "(a document per line) and .parquet files")


def _field(record: Any, key: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where}: no text field {key!r} (the record has {keys}): name it with --text-key")
    return record[key]


def load_tokenizer(folder: str | Path, eos_token: str | None = None) -> tuple[Any, str]:
    """(tokenizers.Tokenizer, its end-of-sequence token) of a local tokenizer folder."""
    from tokenizers import Tokenizer

    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path} has no tokenizer.json (a Hugging Face tokenizer saved with save_pretrained has "
                          "one); give that folder, or --train-bpe VOCAB to train one on the inputs")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = eos_token or _configured_eos(path)
    if eos is None or tokenizer.token_to_id(eos) is None:
        raise ConfigError(f"the tokenizer in {path} names no end-of-sequence token it knows "
                          f"({eos!r}; looked in tokenizer_config.json and special_tokens_map.json): give --eos-token")
    return tokenizer, eos


def _configured_eos(path: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            value = json.loads((path / name).read_text()).get("eos_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                return value
    return None


def train_bpe(files: Sequence[str | Path], vocab_size: int, text_key: str = "text") -> Any:
    """A byte-level BPE of `vocab_size` entries (EOS_TRAINED among them) trained on the inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TRAINED], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(read_documents(files, text_key), trainer)
    return tokenizer


_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_json: str, eos_id: int) -> None:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER.update(tokenizer=Tokenizer.from_str(tokenizer_json), eos=eos_id)


def _encode(texts: list[str]) -> list[np.ndarray]:
    tokenizer, eos = _WORKER["tokenizer"], _WORKER["eos"]
    return [np.asarray([*tokenizer.encode(text, add_special_tokens=False).ids, eos], dtype=np.int64)
            for text in texts]


def _chunks(documents: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    for text in documents:
        chunk.append(text)
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def in_validation(index: int, fraction: float) -> bool:
    """Whether document `index` belongs to the validation split: every 1/fraction-th one."""
    return fraction > 0 and int((index + 1) * fraction) > int(index * fraction)


@dataclass(frozen=True)
class TrainBpe:
    """In place of a tokenizer folder: train a byte-level BPE of `vocab` entries on the corpus itself
    (`paratrain tokenize --train-bpe VOCAB`)."""

    vocab: int


def tokenize_corpus(files: Sequence[str | Path], out: str | Path, *, tokenizer: str | Path | TrainBpe,
                    text_key: str = "text", eos_token: str | None = None, workers: int = 1,
                    val_fraction: float = 0.01, progress: bool = True) -> dict[str, Any]:
    """Write OUT as the module docstring says; returns what tokens.json holds. tokenizer: a local tokenizer folder,
    or TrainBpe(vocab) to train one on the files."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: paratrain tokenize publishes a new folder; remove it or choose another --out")
    if isinstance(tokenizer, TrainBpe) and tokenizer.vocab < 1:
        raise ConfigError(f"--train-bpe VOCAB must be at least 1, got {tokenizer.vocab}")
    if not files:
        raise ConfigError("no input files: give the corpus's .txt, .jsonl or .parquet files")
    if not 0 <= val_fraction < 1 or workers < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1) and --workers >= 1, got {val_fraction} and {workers}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "tokenizer").mkdir()
        if not isinstance(tokenizer, TrainBpe):
            model, eos = load_tokenizer(tokenizer, eos_token)
            for name in TOKENIZER_FILES:
                if (Path(tokenizer) / name).is_file():
                    shutil.copyfile(Path(tokenizer) / name, staging / "tokenizer" / name)
        else:
            model, eos = train_bpe(files, tokenizer.vocab, text_key), EOS_TRAINED
            model.save(str(staging / "tokenizer" / "tokenizer.json"))  # a folder transformers' AutoTokenizer loads
            (staging / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TRAINED, "bos_token": None}, indent=1))
        identity = tokenizer_identity(staging / "tokenizer", eos, model.get_vocab_size(with_added_tokens=True),
                                      model.token_to_id(eos))
        record = _write(files, staging, model, identity, text_key, workers, val_fraction, progress)
        (staging / "tokens.json").write_text(json.dumps(record, indent=1))
        staging.rename(out)
        return record
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(files: Sequence[str | Path], staging: Path, model: Any, identity: dict[str, Any], text_key: str,
           workers: int, val_fraction: float, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    dtype = token_dtype(identity["vocab_size"])
    writers = {"train": IndexedWriter(staging / "train", dtype), "val": IndexedWriter(staging / "val", dtype)}
    setup = (model.to_str(), identity["eos_id"])
    pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, setup) if workers > 1 else None
    if pool is None:
        _start_worker(*setup)
    chunks = _chunks(read_documents(files, text_key))
    encoded = pool.imap(_encode, chunks) if pool is not None else map(_encode, chunks)
    index = 0
    try:
        with tqdm(desc="tokenize", unit=" docs", disable=not progress) as bar:
            for batch in encoded:
                for ids in batch:
                    writers["val" if in_validation(index, val_fraction) else "train"].add(ids)
                    index += 1
                bar.update(len(batch))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        for writer in writers.values():
            writer.close()
    counts = {split: {"documents": len(w.lengths), "tokens": int(sum(w.lengths))} for split, w in writers.items()}
    if val_fraction and not counts["val"]["documents"]:
        raise ConfigError(f"the inputs hold {index} documents, and --val-fraction {val_fraction} puts one in every "
                          f"{1 / val_fraction:g} in the validation split: none fell there; lower it or add documents")
    if not counts["train"]["documents"]:
        raise ConfigError("no document left for the training split: add documents")
    return {"format": "megatron-indexed", "tokenizer": identity, "dtype": str(dtype), **counts,
            "inputs": [str(f) for f in files], "text_key": text_key, "val_fraction": val_fraction}


def tokenizer_identity(folder: str | Path, eos: str, vocab_size: int, eos_id: int) -> dict[str, Any]:
    """What names a tokenizer: the SHA-256 of its tokenizer.json, its vocabulary size and end-of-sequence id."""
    digest = hashlib.sha256(Path(folder, "tokenizer.json").read_bytes()).hexdigest()
    return {"sha256": digest, "vocab_size": vocab_size, "eos_token": eos, "eos_id": eos_id}


def check_tokenizer(data: str | Path, tokenizer: str | Path) -> None:
    """Refuse token files written with another tokenizer than the one in the folder `tokenizer`."""
    meta = Path(data) / "tokens.json"
    if not meta.is_file():
        raise ConfigError(f"{data} has no tokens.json: it was not written by `paratrain tokenize`, so which tokenizer "
                          "wrote it is unknown; tokenize the corpus again with that tokenizer")
    recorded = json.loads(meta.read_text())["tokenizer"]
    digest = hashlib.sha256(Path(tokenizer, "tokenizer.json").read_bytes()).hexdigest()
    if digest != recorded["sha256"]:
        raise ConfigError(f"the token files in {data} were written with another tokenizer (tokenizer.json SHA-256 "
                          f"{recorded['sha256'][:12]}..., vocabulary {recorded['vocab_size']}) than {tokenizer}'s "
                          f"({digest[:12]}...): tokenize the corpus again with `paratrain tokenize --tokenizer "
                          f"{tokenizer}`")
