"""A seeded permutation of ``range(n)`` evaluated index by index, with no table of size n.

A Feistel network over the smallest even number of bits that covers n is a bijection of that
power-of-two range; applying it again until the value falls below n ("cycle walking") makes it
a bijection of ``range(n)``. The loader uses one per (seed, epoch): positions in, instances out,
identical on every rank and every machine without storing or communicating anything.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
ROUNDS = 6


def _mix64(x: int) -> int:
    """SplitMix64's finalizer on a Python int: a well-spread 64-bit hash of ``x``."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """The same finalizer on a uint64 array (numpy arrays wrap on overflow, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A bijection of ``range(n)`` fixed by ``(seed, epoch)``."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 0:
            raise ValueError(f"a permutation of {n} items is not defined: n must be >= 0.")
        self.n = n
        bits = max(2, (n - 1).bit_length()) if n > 1 else 2
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        base = _mix64(_mix64(seed) ^ (epoch + 0x9E3779B97F4A7C15))
        self.keys = [np.uint64(_mix64(base + r)) for r in range(ROUNDS)]

    def _encrypt(self, x_N: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x_N >> shift, x_N & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64_array(right ^ key) & self.mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The images of ``positions`` (each in ``range(n)``), as int64."""
        pos_N = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self.n <= 1:
            return pos_N.copy()
        if pos_N.size and (pos_N.min() < 0 or pos_N.max() >= self.n):
            raise IndexError(f"positions must lie in range({self.n}).")
        out_N = self._encrypt(pos_N.astype(np.uint64))
        outside = out_N >= np.uint64(self.n)
        while outside.any():
            out_N[outside] = self._encrypt(out_N[outside])
            outside = out_N >= np.uint64(self.n)
        return out_N.astype(np.int64)
