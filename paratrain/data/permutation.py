"""A keyed permutation of 0 .. n-1 computed position by position, in O(1) memory.

GlobalOrder shuffles an epoch with torch.randperm(n): 8 bytes a sample, which for a corpus of a trillion tokens in
samples of 4,096 is 2 GB on every rank. A streaming source (paratrain.data.shards) must read with memory that does
not grow with the corpus, so it takes its epoch order from this instead: a bijection on [0, 2^b) built from a
balanced Feistel network of 6 rounds (b even, 2^b >= n), each round's function a 64-bit mix of (the round's key,
the right half), and cycle walking (apply it again while the result is >= n) to land in [0, n). A Feistel network is
a bijection whatever its round function, and cycle walking keeps one: so every sample is visited once an epoch. The
keys come from (seed, epoch) alone, so the order is the same on every rank, for every layout and every number of
reader workers; position p's sample is computed from p without the positions before it (a resume is free).
"""

from __future__ import annotations

import numpy as np

from paratrain.rng import keyed_seed

ROUNDS = 6
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplication wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class KeyedPermutation:
    """A permutation of range(n) keyed by (seed, key): `at(positions)` is the sample at each position."""

    def __init__(self, n: int, *, seed: int, key: str) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(keyed_seed(seed, f"{key}/round{r}")) for r in range(ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) * _GOLDEN >> np.uint64(32)) & self.mask
        return (left << self.half) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """int64: the permuted index of each position (each in [0, n))."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        y = self._encrypt(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle walking: at most a few rounds (2^b < 4n)
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)
