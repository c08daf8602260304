"""Per-client training runtimes: the system heterogeneity of the emulated population."""

from __future__ import annotations

import math

import numpy as np

# The FeLiX authors' profile: half-normal whose median is 10 s of a 60 s spread
# (scale = 60 / (2 sqrt(2 ln 2)) / sqrt(pi) ~ 14.38 s), rounded up, 1 s draws dropped.
FELIX_HALFNORMAL_SCALE = 60.0 / (2.0 * math.sqrt(2.0 * math.log(2.0))) / math.sqrt(math.pi)


def halfnormal_runtimes(
    n: int, rng: np.random.Generator, scale: float = FELIX_HALFNORMAL_SCALE, min_s: float = 2.0
) -> np.ndarray:
    out = np.empty(n)
    filled = 0
    while filled < n:
        draw = np.ceil(np.abs(rng.normal(0.0, scale, size=2 * (n - filled) + 8)))
        draw = draw[draw >= min_s][: n - filled]
        out[filled : filled + len(draw)] = draw
        filled += len(draw)
    return out


def uniform_runtimes(n: int, rng: np.random.Generator, low: float, high: float) -> np.ndarray:
    if not 0 < low <= high:
        raise ValueError("uniform runtimes need 0 < low <= high")
    return rng.uniform(low, high, size=n)
