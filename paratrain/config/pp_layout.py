"""`--pp-layout`: the pipeline cut written out layer by layer, in Megatron-LM's spelling
(`--pipeline-model-parallel-layout`), instead of `--pp-split`'s first-layer indices.

    E     the embedding (the model's first layer)
    t     a transformer block
    m     a multi-token-prediction depth (paratrain runs the depths with the head: written just before L, all or none)
    L     the head and the loss (the last layer)
    |     the border between two pipeline chunks (pp x virtual_stages chunks in all, in chunk order)
    X*n   n times the symbol X; (...)*n n times the group (which may hold borders)

    "Et*3|t*4|t*4|t*3L"    4 chunks of a 14-block GPT: the embedding and the head each beside fewer blocks
    "E|t*12|L"             the embedding and the head alone on the first and last chunk
    "Et|(tt|)*5tL"         7 chunks of a 12-block GPT, the two ends lighter

A model of n layers (the GPT: the embedding, its blocks, the head) is cut into the chunks as written: every layer
once, in order, no chunk empty; E only first, L only last. The result is `pp_split` (paratrain.pipeline.stages).
"""

from __future__ import annotations

import re

from paratrain.config.errors import ConfigError

_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)|([EtmL])\*(\d+)")


def _expand(spec: str) -> str:
    """The spelling with every repetition written out (groups innermost first)."""
    text = spec.replace(" ", "")
    while True:
        expanded = _REPEAT.sub(lambda g: (g.group(1) or g.group(3)) * int(g.group(2) or g.group(4)), text)
        if expanded == text:
            return text
        text = expanded


def layout_split(spec: str, layers: int, *, mtp_depth: int | None = None) -> tuple[int, ...]:
    """pp_split of `spec` for a model of `layers` layers: the first layer of chunks 1 .. (a ConfigError with the
    rule, the numbers and the fix). mtp_depth: the model's MTP depths, which `m` symbols must count if written (None:
    any count)."""
    text = _expand(spec)
    stray = sorted(set(text) - set("EtmL|"))
    if stray or not text:
        raise ConfigError(f"--pp-layout {spec!r}: write the layers as E (embedding), t (block), m (MTP depth), L (head "
                          f"and loss), | between chunks, X*n and (...)*n to repeat; found {stray or 'nothing'}")
    chunks = text.split("|")
    empty = [i for i, chunk in enumerate(chunks) if not chunk.replace("m", "")]
    if empty:
        raise ConfigError(f"--pp-layout {spec!r}: chunk {empty[0]} holds no layer; every pipeline chunk runs at least "
                          "one (an E, t or L)")
    flat = text.replace("|", "")
    if "E" in flat[1:] or "L" in flat[:-1]:
        raise ConfigError(f"--pp-layout {spec!r}: E (the embedding) can only be the first layer and L (the head and "
                          "loss) the last")
    depths = flat.count("m")
    if depths and not text.endswith("m" * depths + "L"):
        raise ConfigError(f"--pp-layout {spec!r}: the MTP depths (m) run with the head: write them just before L, in "
                          "its chunk")
    if depths and mtp_depth is not None and depths != mtp_depth:
        raise ConfigError(f"--pp-layout {spec!r} writes {depths} MTP depths (m) and the model has {mtp_depth}: write "
                          f"{mtp_depth} or none")
    counted = len(flat) - depths
    if counted != layers:
        raise ConfigError(f"--pp-layout {spec!r} covers {counted} layers and the model has {layers} (the embedding, "
                          f"{layers - 2} blocks, the head for the GPT): write every layer once")
    split, seen = [], 0
    for chunk in chunks[:-1]:
        seen += len(chunk.replace("m", ""))
        split.append(seen)
    return tuple(split)


def layout_chunks(spec: str) -> int:
    """The pipeline chunks `spec` writes (its borders + 1)."""
    return _expand(spec).count("|") + 1
