"""Prefixes of stable sorts in O(n): the first ``m`` of ``argsort(..., kind="stable")`` without the sort.

Selectors rank thousands of candidates to keep a few dozen. A full stable argsort costs
O(n log n); a partition finds the m-th value in O(n), and only the ``m`` kept indices are sorted.
Ties are broken by index, exactly as the stable sort breaks them, so the result is identical
index for index (which keeps seeded selections reproducible).
"""
from __future__ import annotations

import numpy as np


def largest_first(values: np.ndarray, m: int) -> np.ndarray:
    """``np.argsort(-values, kind="stable")[:m]``: indices of the ``m`` largest, ties by index."""
    return _stable_prefix(values, m, largest=True)


def smallest_first(values: np.ndarray, m: int) -> np.ndarray:
    """``np.argsort(values, kind="stable")[:m]``: indices of the ``m`` smallest, ties by index."""
    return _stable_prefix(values, m, largest=False)


def kth_largest(values: np.ndarray, k: int) -> float:
    """``np.sort(values)[::-1][k]`` (0-based) in O(n)."""
    j = values.size - 1 - k
    return float(np.partition(values, j)[j])


def _stable_prefix(values: np.ndarray, m: int, largest: bool) -> np.ndarray:
    n = values.size
    m = max(0, min(m, n))
    if m == 0:
        return np.empty(0, dtype=np.int64)
    if 4 * m >= n or np.isnan(values).any():  # the partition would save little, or NaNs break it
        return np.argsort(-values if largest else values, kind="stable")[:m]
    if largest:
        j = n - m
        thr = np.partition(values, j)[j]
        strict = np.flatnonzero(values > thr)
    else:
        thr = np.partition(values, m - 1)[m - 1]
        strict = np.flatnonzero(values < thr)
    ties = np.flatnonzero(values == thr)[: m - strict.size]
    keep = np.sort(np.concatenate([strict, ties]))
    key = -values[keep] if largest else values[keep]
    return keep[np.argsort(key, kind="stable")]
