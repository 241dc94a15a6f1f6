"""Random streams keyed by name, not by rank or by call order.

A generator seeded from (seed, key) gives the same numbers in any layout, which is what the init
of parameters and the global sample order need to be layout-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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


# ---- counter-based random numbers: a pure function of (key, element index) --------------------
#
# Dropout under tensor and sequence parallelism must draw, for every element of the *logical*
# tensor, the number a single device would draw, whichever rank holds that element. A stateful
# generator cannot do that (its numbers depend on how many were drawn before); a hash of the
# element's global index can. Each number is lowbias32 (Wellons 2018, a 32-bit integer mixer) applied
# twice, on the index's low and high 32 bits mixed with a 64-bit key, in int64 arithmetic that never
# overflows (products are split into 16-bit halves), so CPU and CUDA give the same bits.

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_uniform(key: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) as float32 (24 random bits), one per element of `index` (int64,
    >= 0): the same (key, index) gives the same number on any rank and device."""
    key_low, key_high = key & _MASK32, (key >> 32) & _MASK32
    low, high = index & _MASK32, index >> 32
    mixed = _mix32(low ^ key_low)
    mixed = _mix32(mixed ^ high ^ key_high)
    return (mixed >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass
class DropoutStream:
    """Where the training is, for keyed dropout: shared by every KeyedDropout of a model and moved on
    by its methods (the engine and the pipeline executor call them). A mask element is keyed by
    (seed, step, module name, global position), so it does not depend on the layout, on the
    micro-batch split, or on recomputation (the same forward twice draws the same mask)."""

    seed: int
    step: int = 0
    """Optimizer steps taken (a new mask every step)."""
    row_offset: int = 0
    """Global-batch row of this rank's micro-batch's first row."""

    def at_rows(self, first_row: int) -> None:
        """The coming forward runs the global batch's rows from `first_row` on."""
        self.row_offset = first_row

    def advance(self) -> int:
        """One optimizer step taken: the next step draws new masks. Returns the new step count."""
        self.step += 1
        return self.step

    def restore(self, step: int) -> None:
        """Go on from a checkpoint taken after `step` optimizer steps."""
        self.step = step

    def key(self, name: str) -> int:
        return keyed_seed(self.seed, f"dropout/{self.step}/{name}")
