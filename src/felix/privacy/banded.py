"""Banded matrix factorisation of the prefix sum (Choquette-Choo et al., ICML 2023 and NeurIPS
2023), with the banded square root as the factor (Kalinin and Lampert, NeurIPS 2024).

The server releases the noised prefix sums A x + B z of the clipped sums x_1, x_2, ..., where A is
the prefix-sum matrix (lower-triangular ones), A = B C, and z is Gaussian. C is the Toeplitz square
root of A (the coefficients of (1 - x)^(-1/2): 1, 1/2, 3/8, 5/16, ...) cut to ``bands`` diagonals
(C[i, j] = 0 for i - j >= bands), and B = A C^-1. Equivalently, A x + B z = A (x + w) with
w = C^-1 z: each released increment carries w_t, the correlated noise, which forward substitution
with the banded C gives from the last ``bands - 1`` of its own values:

    w_t = (z_t - sum_{k=1..bands-1} C_k w_(t-k)) / C_0,

so the stream needs no horizon and holds ``bands - 1`` past noise vectors (float64, one model
each). ``bands = 1`` is C = I: independent noise on every increment, the central Gaussian
mechanism.

Privacy is that of the Gaussian mechanism C x + z. A client whose contributions (each at most C in
L2) fall in aggregations at least ``bands`` apart touches columns of C with disjoint supports, so
C x moves by at most sqrt(k) times C's largest column norm, k its number of aggregations
(:func:`sensitivity`, exact); the orchestrator enforces that separation (``felix.core.separation``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np


def sqrt_coefficients(n: int) -> np.ndarray:
    """The first ``n`` coefficients of (1 - x)^(-1/2): c_0 = 1, c_i = c_(i-1) (2i - 1) / (2i),
    the Toeplitz square root of the prefix-sum matrix (C C = A)."""
    c = np.ones(n, dtype=np.float64)
    for i in range(1, n):
        c[i] = c[i - 1] * (2 * i - 1) / (2 * i)
    return c


def inverse_coefficients(c: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of the power series 1 / c(x) (C^-1's, Toeplitz): series
    division, d_0 = 1 / c_0, d_t = -(sum_{k=1..t} c_k d_(t-k)) / c_0."""
    d = np.zeros(n, dtype=np.float64)
    for t in range(n):
        k = min(t, len(c) - 1)
        acc = 1.0 if t == 0 else -float(np.dot(c[1 : k + 1], d[t - 1 :: -1][:k]))
        d[t] = acc / c[0]
    return d


def prefix_coefficients(c: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of B = A C^-1 (Toeplitz: the running sums of C^-1's)."""
    return np.cumsum(inverse_coefficients(c, n))


def toeplitz(coefficients: np.ndarray, n: int) -> np.ndarray:
    """The n x n lower-triangular Toeplitz matrix whose k-th subdiagonal is ``coefficients[k]``
    (zero beyond them)."""
    m = np.zeros((n, n), dtype=np.float64)
    for k, v in enumerate(coefficients[:n]):
        m += np.diag(np.full(n - k, v), -k)
    return m


def column_norm(bands: int, steps: int, column: int = 0) -> float:
    """The norm of column ``column`` (from 0) of the ``bands``-banded square root over ``steps``
    aggregations: its first min(bands, steps - column) coefficients. The first is the largest."""
    return math.sqrt(float(np.square(sqrt_coefficients(max(min(bands, steps - column), 0))).sum()))


def participations(steps: int, bands: int, cap: int | None) -> int:
    """The most aggregations of ``steps`` one client can contribute to, ``bands`` apart, within
    ``cap`` (``max_participations``; none: the separation alone)."""
    most = -(-steps // bands)  # ceil
    return most if cap is None else min(cap, most)


def sensitivity(steps: int, bands: int, cap: int | None) -> float:
    """The L2 sensitivity of C x, in units of the clip norm, to one client after ``steps``
    aggregations. Its k contributions touch columns with disjoint supports, so the squares of
    their norms add; column norms do not grow along the run, so the worst case takes columns
    0, b, 2b, ...: at most sqrt(k) times the largest column norm, equal to it when the run holds
    k whole bands (k b <= steps), less when the last column is cut by the run's end (one
    cumulative sum of squares, so the cost does not grow with the run)."""
    k = participations(steps, bands, cap)
    squares = np.concatenate([[0.0], np.cumsum(np.square(sqrt_coefficients(bands)))])
    whole = min(k, steps // bands)  # columns with all b coefficients inside the run
    cut = steps - whole * bands if k > whole else 0  # the rows left to the last column
    return math.sqrt(whole * float(squares[bands]) + float(squares[cut]))


class BandedNoise:
    """The correlated noise w = C^-1 z of each released increment, z ~ N(0, std^2) per coordinate
    drawn from ``rng`` (reproducible from a seeded generator), by forward substitution over the
    last ``bands - 1`` values of w (C_0 = 1: no division)."""

    def __init__(self, size: int, std: float, bands: int, rng: np.random.Generator) -> None:
        if bands < 1:
            raise ValueError(f"bands must be >= 1, not {bands}")
        self.size = int(size)
        self.std = float(std)
        self.bands = int(bands)
        self.rng = rng
        self.coefficients = sqrt_coefficients(self.bands)
        self.steps = 0
        self._past: deque[np.ndarray] = deque(maxlen=self.bands - 1)  # w_(t-1), w_(t-2), ...

    def advance(self) -> np.ndarray:
        """One step more: the noise of its increment (float64)."""
        self.steps += 1
        w = self.rng.normal(0.0, self.std, self.size)
        scratch = np.empty_like(w)
        for c_k, past in zip(self.coefficients[1:], self._past, strict=False):
            w -= np.multiply(past, c_k, out=scratch)
        if self.bands > 1:
            self._past.appendleft(w.copy())
        return w

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "past": [p.copy() for p in self._past]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._past = deque((np.asarray(p, dtype=np.float64) for p in state["past"]), maxlen=self.bands - 1)


__all__ = [
    "BandedNoise",
    "column_norm",
    "inverse_coefficients",
    "participations",
    "prefix_coefficients",
    "sensitivity",
    "sqrt_coefficients",
    "toeplitz",
]
