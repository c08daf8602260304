"""Order statistics and prefixes of stable sorts in O(n), without sorting the candidates.

Selectors rank thousands of candidates to keep a few dozen. A full stable argsort costs
O(n log n). Here the m-th value is found first (``kth_largest``: a strided sample gives a
threshold just below it, one comparison pass keeps the few values above, and a partition of
those gives the exact value; a full partition when the sample misjudged), then only the kept
indices are sorted. Ties are broken by index, exactly as the stable sort breaks them, so every
result is identical, index for index, to the sort it replaces (which keeps seeded selections
reproducible).
"""

from __future__ import annotations

import numpy as np

_SAMPLE_STEP = 16  # one value in 16 estimates the threshold
_DIRECT = 2048  # below this many values a plain partition is as fast


def largest_first(values: np.ndarray, m: int) -> np.ndarray:
    """``np.argsort(-values, kind="stable")[:m]``: indices of the ``m`` largest, ties by index."""
    return _stable_prefix(values, m, largest=True)


def smallest_first(values: np.ndarray, m: int) -> np.ndarray:
    """``np.argsort(values, kind="stable")[:m]``: indices of the ``m`` smallest, ties by index."""
    return _stable_prefix(values, m, largest=False)


def kth_largest(values: np.ndarray, k: int) -> float:
    """``np.sort(values)[::-1][k]`` (0-based; NaN-free values) in O(n)."""
    n = values.size
    if not 0 <= k < n:
        raise IndexError(f"rank {k} out of {n} values")
    if n > _DIRECT:
        sample = values[::_SAMPLE_STEP]
        ks = min(sample.size - 1, int(1.5 * (k + 1) / _SAMPLE_STEP) + 8)  # margin: err on the low side
        j = sample.size - 1 - ks
        thr = np.partition(sample, j)[j]
        top = values.take(np.flatnonzero(values >= thr))
        if top.size > k:  # then ``top`` holds the k + 1 largest values, ties included
            j = top.size - 1 - k
            return float(np.partition(top, j)[j])
    j = n - 1 - k
    return float(np.partition(values, j)[j])


def _stable_prefix(values: np.ndarray, m: int, largest: bool) -> np.ndarray:
    n = values.size
    m = max(0, min(m, n))
    if m == 0:
        return np.empty(0, dtype=np.int64)
    if 4 * m >= n or np.isnan(values).any():  # the selection would save little, or NaNs break it
        return np.argsort(-values if largest else values, kind="stable")[:m]
    if largest:
        thr = kth_largest(values, m - 1)
        strict = np.flatnonzero(values > thr)
    else:
        thr = -kth_largest(-values, m - 1)
        strict = np.flatnonzero(values < thr)
    ties = np.flatnonzero(values == thr)[: m - strict.size]
    keep = np.concatenate([strict, ties])
    if ties.size and strict.size:
        keep.sort()
    key = -values[keep] if largest else values[keep]
    return keep[np.argsort(key, kind="stable")]
