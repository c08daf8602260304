"""The DAFL planner as it was before the compiled kernel (commit ca918d5, numpy path), kept only
so that tests can check that the kernel's exact rule plans identically. Not part of the package."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from felix.strategies.dataplans.dafl import P_RTOL, DaflParams


def legacy_plan(n_mat: NDArray[np.int64], params: DaflParams) -> NDArray[np.int64]:
    """The old planner's augmentation matrix for ``n_mat`` (no validation)."""
    with np.errstate(invalid="ignore"):
        return _Greedy(np.asarray(n_mat, dtype=np.int64), params).run()


def _water_fill(totals: NDArray[np.int64], step: int, tau: float) -> NDArray[np.intp]:
    """Classes that successive ``step``-sized additions to the rarest class hit,
    up to the first state with ``J <= tau``; equal counts go lowest index first.

    Adding ``step`` to a class whose count is ``v`` happens before any addition
    to a class at a larger count, so the additions, ordered by the count before
    each of them (then by class), *are* the water-filling sequence: every
    prefix of it can be scored at once instead of one greedy step at a time.
    The list is grown geometrically because where ``J`` crosses ``tau`` is not
    known in advance.
    """
    n_classes = totals.size
    n0 = int(totals.sum())
    s2_0 = int(np.dot(totals, totals))
    if _meets_tau(np.array([s2_0]), np.array([n0]), n_classes, tau)[0]:
        return np.zeros(0, dtype=np.intp)
    top = int(totals.max())
    headroom = step
    while True:
        level = top + headroom
        reps = np.maximum(0, -((totals - level) // step))  # ceil((level - count) / step)
        classes = np.repeat(np.arange(n_classes), reps)
        offsets = np.arange(classes.size) - np.repeat(np.cumsum(reps) - reps, reps)
        before = totals[classes] + step * offsets
        order = np.lexsort((classes, before))
        s2 = s2_0 + np.cumsum(2 * step * before[order] + step * step)
        n = n0 + step * np.arange(1, classes.size + 1, dtype=np.int64)
        ok = _meets_tau(s2, n, n_classes, tau)
        if np.any(ok):
            return classes[order][: int(np.argmax(ok)) + 1]
        headroom *= 2


def _meets_tau(s2: NDArray[np.int64], n: NDArray[np.int64], n_classes: int, tau: float) -> NDArray[np.bool_]:
    """``J <= tau`` exactly, for ``J = S2 / n^2 - 1/C`` given the integers
    ``S2`` (sum of squared class totals) and ``n``.

    Exactness matters: integer counts hit ``J == tau`` exactly more often than
    one would think (e.g. ``J = 1/1000`` on the paper's D3), and there the float
    formulas disagree with each other. ``tau`` is taken at its exact binary
    value. Floats decide wherever they are safely away from the boundary;
    the few near-boundary entries are settled in integers.
    """
    numerator = n_classes * s2 - n * n  # J = numerator / (C n^2); int64 is exact while C n^2 < 2^63
    denominator = n_classes * n * n
    bound = tau * denominator.astype(np.float64)
    ok = numerator <= bound
    for i in np.flatnonzero(np.abs(numerator - bound) <= 1e-9 * bound + 1.0):
        p, q = tau.as_integer_ratio()
        ok[i] = int(numerator[i]) * q <= p * int(denominator[i])
    return ok


class _GreedySetup:
    """What both planner paths derive from N and the parameters, so they decide alike."""

    def _setup(self, n_mat: NDArray[np.int64], params: DaflParams) -> NDArray[np.int64]:
        """Keep the non-empty clients and the P weights; returns their count rows."""
        self.tau = params.tau
        self.full_shape = n_mat.shape
        self.rows = np.flatnonzero(n_mat.sum(axis=1) > 0)
        self.step = params.step
        self.alpha = params.lambda1 * params.zeta_prime / params.epsilon
        self.beta = params.lambda2 * params.zeta
        self.kappa = params.drift_weight
        counts = n_mat[self.rows]
        self.n_classes = counts.shape[1]
        return counts


class _Greedy(_GreedySetup):
    """Algorithm 1 on the non-empty clients of ``N``, state updated in place."""

    def __init__(self, n_mat: NDArray[np.int64], params: DaflParams) -> None:
        counts = self._setup(n_mat, params)
        s = self.step

        self.counts = counts.astype(np.float64)  # N + A, exact while < 2**53
        self.added = np.zeros_like(counts)
        self.blocked = np.where(counts > 0, 0.0, np.inf)  # class-preserving: no new classes
        self.sizes = self.counts.sum(axis=1)  # n_k + a_k
        self.aug_sizes = np.zeros(len(self.rows))  # a_k
        self.squares = np.einsum("kc,kc->k", self.counts, self.counts)  # Q_k
        self.totals = counts.sum(axis=0)  # n^(c), int64
        self.n = int(self.totals.sum())
        self.s2 = int(np.dot(self.totals, self.totals))
        self.max_size = float(self.sizes.max())
        self.max_aug = 0.0
        # Per-row terms of the candidates' P, refreshed only for the row that changes.
        self.ratio = self.squares / self.sizes  # Q_k / n_k
        self.delta = (self.squares + s * s) / (self.sizes + s) - self.ratio
        self.scaled = self.counts / (self.sizes + s)[:, None] + self.blocked
        # alpha * zeta' * max_k(n_k + a_k) and beta * max_k a_k after a move on each row.
        self.width_if_grown = self.alpha * (self.sizes + s)
        self.aug_if_grown = self.beta * (self.aug_sizes + s)
        self.width = np.maximum(self.width_if_grown, self.alpha * self.max_size)
        self.extra = np.maximum(self.aug_if_grown, self.beta * self.max_aug)

    def run(self) -> NDArray[np.int64]:
        with np.errstate(invalid="ignore"):  # 0 * inf for non-candidates, see _best
            self._phase1()
            self._phase2()
        full = np.zeros(self.full_shape, dtype=np.int64)
        full[self.rows] = self.added
        return full

    def _phase1(self) -> None:
        """While ``J > tau``: the rarest classes' pairs, ties broken by P."""
        phase1 = _water_fill(self.totals, self.step, self.tau).size
        tied = self.totals == self.totals.min()
        n_tied = int(tied.sum())
        for _ in range(phase1):
            k, c, _value = self._best(tied)
            self._add(k, c)
            tied[c] = False
            n_tied -= 1
            if n_tied == 0:
                tied = self.totals == self.totals.min()
                n_tied = int(tied.sum())

    def _phase2(self) -> None:
        """While some pair keeps ``J <= tau`` and lowers P: the one lowering it most."""
        current = self._objective()
        while True:
            feasible = self._feasible()
            if not feasible.any():
                break
            k, c, value = self._best(feasible)
            if not value < current - P_RTOL * current:
                break
            self._add(k, c)
            current = value

    def _objective(self) -> float:
        """P of the current state."""
        imbalance = math.fsum(self.ratio) / self.n - self.s2 / self.n**2
        return self.alpha * self.max_size * (1.0 + self.kappa * imbalance) + self.beta * self.max_aug

    def _feasible(self) -> NDArray[np.bool_]:
        """Classes to which ``s`` more samples keep ``J <= tau``.

        The ``J`` after the move grows with the class's total, so this is the
        largest total that still qualifies, found once in exact integers.
        """
        s = self.step
        n1 = self.n + s
        p, q = self.tau.as_integer_ratio()
        c = self.n_classes
        # J' <= p/q  <=>  2 s q C g <= p C n1^2 + q n1^2 - q C (S2 + s^2)
        limit = (p * c * n1 * n1 + q * n1 * n1 - q * c * (self.s2 + s * s)) // (2 * s * q * c)
        return self.totals <= limit

    def _best(self, allowed: NDArray[np.bool_]) -> tuple[int, int, float]:
        """The candidate with the smallest P among classes ``allowed`` (tie rule
        in the module docstring), and that P.

        P after adding ``s`` to ``(k, c)`` is ``width_k * (inner_k + slope * h_kc) + extra_k``
        with ``h_kc = x_kc / (n_k + s) - n^(c) / n'``. Non-candidates have
        ``h = inf``, which turns P into inf or NaN; both lose every comparison.
        """
        s = self.step
        inv = 1.0 / (self.n + s)
        h = self.scaled - np.where(allowed, self.totals * inv, -np.inf)
        h_row = np.minimum.reduce(h, axis=1)
        kappa_n = self.kappa * inv
        shared = 1.0 + kappa_n * (math.fsum(self.ratio) - (self.s2 + s * s) * inv)
        slope = 2 * s * kappa_n
        inner = self.delta * kappa_n + shared
        width, extra = self.width, self.extra
        p_row = width * (inner + slope * h_row) + extra
        threshold = np.fmin.reduce(p_row)
        threshold += P_RTOL * threshold
        k = int((p_row <= threshold).argmax())
        row = h[k]
        scale = width[k] * slope
        if scale > 0:
            # First class of row k within the threshold, mapped back to h.
            c = int((row <= ((threshold - extra[k]) / width[k] - inner[k]) / slope).argmax())
        else:  # P does not depend on h: every candidate of the row ties
            c = int((row < np.inf).argmax())
        return k, c, float(width[k] * (inner[k] + slope * row[c]) + extra[k])

    def _add(self, k: int, c: int) -> None:
        s = self.step
        x = self.counts[k, c]
        self.counts[k, c] = x + s
        self.added[k, c] += s
        self.squares[k] += 2 * s * x + s * s
        self.sizes[k] += s
        self.aug_sizes[k] += s
        self.totals[c] += s
        self.n += s
        self.s2 += 2 * s * (int(self.totals[c]) - s) + s * s
        size = self.sizes[k]
        self.ratio[k] = self.squares[k] / size
        self.delta[k] = (self.squares[k] + s * s) / (size + s) - self.ratio[k]
        self.scaled[k] = self.counts[k] / (size + s) + self.blocked[k]
        self.width_if_grown[k] = self.alpha * (size + s)
        self.aug_if_grown[k] = self.beta * (self.aug_sizes[k] + s)
        if size > self.max_size:
            self.max_size = float(size)
            np.maximum(self.width_if_grown, self.alpha * self.max_size, out=self.width)
        else:
            self.width[k] = max(self.width_if_grown[k], self.alpha * self.max_size)
        if self.aug_sizes[k] > self.max_aug:
            self.max_aug = float(self.aug_sizes[k])
            np.maximum(self.aug_if_grown, self.beta * self.max_aug, out=self.extra)
        else:
            self.extra[k] = max(self.aug_if_grown[k], self.beta * self.max_aug)
