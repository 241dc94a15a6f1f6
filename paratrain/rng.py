"""Random streams keyed by name, not by rank or by call order.

A generator seeded from (seed, key) gives the same numbers in any layout, which is what the init
of parameters and the global sample order need to be layout-free.
"""

from __future__ import annotations

import hashlib

import torch


def keyed_seed(seed: int, key: str) -> int:
    """A 63-bit seed that depends only on (seed, key)."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keyed_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, key)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(keyed_seed(seed, key))
    return generator
