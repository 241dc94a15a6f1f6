"""Keys that name modules, parameters or buffers of a model: one matching rule for every plan and rule table.

A key matches a dotted name by suffix ("attn.qkv" matches "blocks.3.attn.qkv", never "blocks.3.xattn.qkv")
or, when it holds a glob character, as a glob over the whole name ("blocks.*.mlp.up").
"""

from __future__ import annotations

import fnmatch


def name_matches(key: str, name: str) -> bool:
    if any(c in key for c in "*?["):
        return fnmatch.fnmatchcase(name, key)
    return name == key or name.endswith("." + key)
