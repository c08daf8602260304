"""Fixed-point quantisation into Z_(2^modulus_bits), and back.

A client's contribution is the vector ``[w, w * delta]``: ``w`` in [0, 1] is its aggregation weight
divided by ``max_weight``, ``delta`` is clipped coordinate-wise to ``[-clipping_range,
clipping_range]``. Each coordinate maps to an integer in [0, 2^quantization_bits - 1]
(round to nearest): the weight by ``w * (2^b - 1)``, the rest by ``(x + c) / (2c) * (2^b - 1)``.
The sum of n such vectors stays below 2^modulus_bits when ``n * (2^b - 1) < 2^modulus_bits``
(the config refuses a group that could overflow), so the server divides exactly.

Arithmetic is done in uint32 (modulus_bits <= 32) or uint64 words, whose wrap-around is
arithmetic mod 2^32 or 2^64; a multiple of 2^modulus_bits, so reducing at the end is exact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Quantizer:
    """The fixed-point map of one group (its parameters come from the config)."""

    clipping_range: float
    quantization_bits: int
    modulus_bits: int

    @property
    def dtype(self) -> type[np.unsignedinteger]:
        return np.uint32 if self.modulus_bits <= 32 else np.uint64

    @property
    def mask(self) -> int:
        """2^modulus_bits - 1: a reduced word is ``word & mask``."""
        return (1 << self.modulus_bits) - 1

    @property
    def levels(self) -> int:
        return (1 << self.quantization_bits) - 1

    def encode(self, weight: float, delta: np.ndarray) -> np.ndarray:
        """``[w, w * delta]`` as words: ``weight`` in [0, 1] (clamped), ``delta`` clipped."""
        w = min(max(float(weight), 0.0), 1.0)
        c = self.clipping_range
        x = np.clip(np.asarray(delta, dtype=np.float64), -c, c) * w
        out = np.empty(x.size + 1, dtype=self.dtype)
        out[0] = round(w * self.levels)
        out[1:] = np.rint((x + c) * (self.levels / (2 * c))).astype(self.dtype)
        return out

    def reduce(self, words: np.ndarray) -> np.ndarray:
        """Words mod 2^modulus_bits (a no-op at 32 or 64 bits)."""
        if self.modulus_bits in (32, 64):
            return words
        return words & self.dtype(self.mask)

    def decode_sum(self, total: np.ndarray, count: int) -> tuple[float, np.ndarray]:
        """The sum of ``count`` encoded vectors (reduced) as ``(sum of w, sum of w * delta)``."""
        c = self.clipping_range
        wsum = float(total[0]) / self.levels
        xsum = total[1:].astype(np.float64) * (2 * c / self.levels) - count * c
        return wsum, xsum


__all__ = ["Quantizer"]
