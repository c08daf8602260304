"""Weighted sampling without replacement, draw for draw as numpy's ``Generator.choice`` does it.

Oort samples its exploit and explore picks with ``choice(..., replace=False, p=...)``. Numpy
runs that as a loop in Python: draw the missing picks from the cumulative distribution, keep the
first occurrence of each, zero the weights of those taken, repeat. Around the loop it validates
``p`` and ranks the draws with ``np.unique``, which on a few dozen picks costs more than the
sampling itself. ``choice_by_weight`` runs the same loop on the same arrays (the same uniform
draws in the same order, the same cumulative sums and searches), so it returns exactly what
numpy returns and leaves the generator in the same state; ``tests/test_oort.py`` checks this
against ``Generator.choice`` itself.
"""

from __future__ import annotations

import numpy as np


def choice_by_weight(p: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``rng.choice(p.size, size=n, replace=False, p=p)`` for float64 probabilities ``p`` that sum to 1.

    When fewer than ``n`` entries of ``p`` are positive (weights that underflowed), numpy's own
    call is made, and raises as it would.
    """
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    if np.count_nonzero(p > 0) < n:
        return rng.choice(p.size, size=n, replace=False, p=p)
    p = p.copy()
    found = np.empty(n, dtype=np.int64)
    got = 0
    while got < n:
        x = rng.random(n - got)
        if got:
            p[found[:got]] = 0.0
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        drawn = dict.fromkeys(cdf.searchsorted(x, side="right").tolist())  # distinct, first drawn first
        found[got : got + len(drawn)] = list(drawn)
        got += len(drawn)
    return found
