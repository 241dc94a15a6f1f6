"""`paratrain tokenize --chat`: conversations to token files with a loss mask (loss on the assistant's tokens only).

    paratrain tokenize chats.jsonl --chat --tokenizer ./my-llama --out data/

Each .jsonl record holds a conversation, `messages`: [{"role": "system" | "user" | "assistant" | ..., "content": ...}].
The tokenizer folder's chat template (its tokenizer_config.json `chat_template`, rendered by transformers) turns it
into text, tokenized whole; which characters are the assistant's is found by rendering it up to each assistant
message:

    its header           render(messages[:k], add_generation_prompt=True)
    through message k    render(messages[:k + 1])

the characters between the two are the assistant's (its content and its end-of-turn marker), and a token is a loss
token when it starts among them (the tokenizer's offsets); every other token (system and user turns, headers) is
context only. Both renderings must begin the whole conversation's text (the template renders a conversation's
beginning the same way whatever follows); a template that breaks this is refused, naming the record. The conversation ends with the end-of-sequence id (appended
when the template does not end it so; a loss token when the last message is the assistant's), so each conversation is
one document: `--documents` masking keeps packed conversations apart.

Written as `paratrain tokenize` writes (paratrain.data.tokenize), plus the mask in the same indexed layout, uint8:

    OUT/train.bin, train.idx, val.bin, val.idx                   the tokens
    OUT/train_mask.bin, train_mask.idx, val_mask.bin, val_mask.idx  1 where a token is a target the loss counts
    OUT/tokenizer/, OUT/tokens.json                              as paratrain tokenize's ("chat": its key and counts)

A run reading the folder (`paratrain train --hf DIR --data OUT`) leaves every target whose mask is 0 out of the loss
(label -100), in every layout alike.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from paratrain.config.errors import ConfigError
from paratrain.data.indexed import IndexedWriter, token_dtype
from paratrain.data.tokenize import TOKENIZER_FILES, in_validation, load_tokenizer, tokenizer_identity


def read_conversations(files: Sequence[str | Path], key: str = "messages") -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) of every record of the .jsonl files, in order."""
    for name in files:
        path = Path(name)
        if not path.is_file() or path.suffix.lower() not in (".jsonl", ".json"):
            raise ConfigError(f"input {str(path)!r}: --chat reads .jsonl files, a conversation ({key!r}: a list of "
                              "{'role', 'content'} messages) per line")
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                record = json.loads(line)
                messages = record.get(key) if isinstance(record, dict) else None
                if not isinstance(messages, list) or not messages or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages):
                    raise ConfigError(f"{where}: no conversation under {key!r} (a non-empty list of "
                                      "{'role': str, 'content': str} messages); name the field with --messages-key")
                yield where, messages


class ChatEncoder:
    """A conversation -> (token ids, loss mask) with a tokenizer folder's chat template."""

    def __init__(self, folder: str | Path, eos_token: str | None = None) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ConfigError("--chat renders the tokenizer's chat template with transformers: pip install "
                              "transformers") from error
        self.template = AutoTokenizer.from_pretrained(str(folder))
        if not self.template.chat_template:
            raise ConfigError(f"the tokenizer in {folder} has no chat template (tokenizer_config.json "
                              "'chat_template'): --chat needs the template the model is to be prompted with")
        self.tokenizer, self.eos = load_tokenizer(folder, eos_token)
        self.eos_id = self.tokenizer.token_to_id(self.eos)

    def _text(self, messages: list[dict], *, header: bool = False) -> str:
        if not messages and not header:
            return ""
        return self.template.apply_chat_template(messages, tokenize=False, add_generation_prompt=header)

    def encode(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's ids (the end-of-sequence id last) and loss mask (1: a token the loss counts)."""
        full = self._text(messages)
        spans = []  # [start, end) characters of each assistant message past its header
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            header, through = self._text(messages[:k], header=True), self._text(messages[:k + 1])
            if not (full.startswith(header) and full.startswith(through) and through.startswith(header)):
                raise ConfigError(f"{where}: the chat template renders the conversation's beginning through message "
                                  f"{k + 1} differently when more follows, so which characters are the assistant's "
                                  "is not defined: use a template that renders each turn the same whatever comes "
                                  "after it")
            spans.append((len(header), len(through)))
        encoding = self.tokenizer.encode(full, add_special_tokens=False)
        ids = list(encoding.ids)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
        if not ids or ids[-1] != self.eos_id:
            ids.append(self.eos_id)
            mask.append(int(messages[-1]["role"] == "assistant"))
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def tokenize_chat(files: Sequence[str | Path], out: str | Path, *, tokenizer: str | Path, messages_key: str = "messages",
                  eos_token: str | None = None, val_fraction: float = 0.01, progress: bool = True) -> dict[str, Any]:
    """Write OUT as the module docstring says; returns what tokens.json holds."""
    from tqdm import tqdm

    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: paratrain tokenize publishes a new folder; remove it or choose another --out")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    encoder = ChatEncoder(tokenizer, eos_token)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copyfile(Path(tokenizer) / name, staging / "tokenizer" / name)
        identity = tokenizer_identity(staging / "tokenizer", encoder.eos,
                                      encoder.tokenizer.get_vocab_size(with_added_tokens=True), encoder.eos_id)
        dtype = token_dtype(identity["vocab_size"])
        splits = ("train", "val")
        tokens = {s: IndexedWriter(staging / s, dtype) for s in splits}
        masks = {s: IndexedWriter(staging / f"{s}_mask", np.dtype(np.uint8)) for s in splits}
        loss_tokens = dict.fromkeys(splits, 0)
        index = 0
        try:
            for where, messages in tqdm(read_conversations(files, messages_key), desc="tokenize", unit=" chats",
                                        disable=not progress):
                ids, mask = encoder.encode(messages, where)
                split = "val" if in_validation(index, val_fraction) else "train"
                tokens[split].add(ids)
                masks[split].add(mask)
                loss_tokens[split] += int(mask.sum())
                index += 1
        finally:
            for writer in (*tokens.values(), *masks.values()):
                writer.close()
        counts = {s: {"documents": len(tokens[s].lengths), "tokens": int(sum(tokens[s].lengths)),
                      "loss_tokens": loss_tokens[s]} for s in splits}
        if not counts["train"]["documents"] or (val_fraction and not counts["val"]["documents"]):
            raise ConfigError(f"the inputs hold {index} conversations: too few for a training and a validation split "
                              f"(--val-fraction {val_fraction}); add conversations or lower it")
        record = {"format": "megatron-indexed", "tokenizer": identity, "dtype": str(dtype), **counts,
                  "inputs": [str(f) for f in files], "chat": {"messages_key": messages_key, "loss_mask": True},
                  "val_fraction": val_fraction}
        (staging / "tokens.json").write_text(json.dumps(record, indent=1))
        staging.rename(out)
        return record
    finally:
        shutil.rmtree(staging, ignore_errors=True)
