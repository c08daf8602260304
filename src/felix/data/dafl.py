"""DAFL augmentation planning (Algorithm 1 of the paper) and the Local Balancing baseline.

The server knows only the client x class count matrix ``N``. DAFL picks an
augmentation matrix ``A`` (extra samples per client and class) that brings the
global class imbalance ``J(N + A)`` down to ``tau`` while keeping the estimated
wall-clock cost ``P = lambda1 * T_t + lambda2 * T_a`` (eqs. 16-17) low, with
the paper's two-phase greedy:

* Phase 1, while ``J > tau``: add ``s`` samples to the pair ``(k, c)`` whose
  addition lowers ``J`` most; ties broken by the smallest resulting ``P``.
* Phase 2, while some feasible pair (``J`` stays ``<= tau``) lowers ``P``: add
  ``s`` samples to the feasible pair that lowers ``P`` most.

Decisions that the paper leaves open, fixed here so that the result is one
well-defined integer matrix:

* Only pairs with ``n_k^(c) > 0`` are candidates. Augmentation is
  class-preserving, so a client cannot create a class it holds no sample of.
  (Every cell of the paper's Table II is positive, so this changes nothing
  there.) A class with no sample on any client is rejected, because ``J`` could
  then never fall below ``1/C^2``.
* Ties. After ``s`` more samples the total is the same whichever pair is
  chosen, so the ``J`` of a candidate is a function of its class's global count
  alone, smaller count meaning lower ``J``: Phase 1 always augments one of the
  globally rarest classes and its ``J`` ties are exact, decided on integers.
  ``P`` values are treated as tied when within ``P_RTOL`` (relative) of the
  smallest one: that absorbs floating-point noise (~1e-16) yet is far below
  the gaps between distinct candidates (one sample moves ``P`` by ~1/(n n_k)
  relative). Exact ties are common (clients or classes in identical states).
  Among tied pairs the first in row-major order wins (lowest client, then
  lowest class). Phase 2 only accepts a move that lowers ``P`` by more than
  ``P_RTOL * P``.
* ``J <= tau`` is decided exactly, on integers, with ``tau`` at its binary
  value: integer counts hit ``J == tau`` exactly (``J = 1/1000`` occurs while
  planning the paper's D3), where float formulas for ``J`` disagree.

Speed. A direct implementation evaluates ``J`` and ``P`` from scratch for each
of the ``K*C`` candidates at every step (O(K^2 C^2) per added step; 25-55 s for
the paper's 8 x 8 cases). Here every step costs a fixed handful of numpy
operations on ``K x C`` arrays, using these facts:

* the number of Phase 1 steps depends only on the class totals, so it is
  computed up front from the water-filling order of the totals, and Phase 1
  never evaluates ``J``;
* ``I = (1/n) sum_k Q_k / n_k - S2 / n^2`` with ``Q_k = sum_c (n_k^(c))^2`` and
  ``S2 = sum_c (n^(c))^2``, so the ``I`` after adding ``s`` to ``(k, c)`` is
  ``base_k + (2 s / n') * (x_kc / (n_k + s) - n^(c) / n')`` with ``n' = n + s``:
  a per-client term plus one ``K x C`` matrix, of which only one row changes
  per step;
* ``max_k`` in ``T_t`` and ``T_a`` after the move is ``max(old max, new row)``.

Small matrices (up to ``SCALAR_MAX_CELLS`` non-empty client x class cells, the
paper's 8 x 8 included) run the same steps on Python floats (``_ScalarGreedy``),
in the same order of floating-point operations, so both paths decide alike bit
for bit; on 8 x 8 that is about 4 times faster than numpy, whose per-call
overhead is most of a step there. Sums of the ``K`` per-client ratios use
``math.fsum`` in both (correctly rounded, so independent of summation order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from felix.data.imbalance import (
    as_count_matrix,
    global_class_imbalance,
    label_proportion_imbalance,
)
from felix.data.imbalance import objective as _objective

__all__ = [
    "P_RTOL",
    "SCALAR_MAX_CELLS",
    "AugmentationPlan",
    "DaflParams",
    "plan_dafl",
    "plan_local_balancing",
    "validate_counts",
]

#: Relative tolerance under which two values of the objective P count as equal.
P_RTOL: Final = 1e-12

#: Largest (non-empty clients x classes) planned on Python floats rather than numpy arrays: below
#: it numpy's per-call overhead dominates a greedy step, above it the K x C work does.
SCALAR_MAX_CELLS: Final = 512


@dataclass(frozen=True)
class DaflParams:
    """Every constant of Problem 1 and Algorithm 1; defaults are the paper's
    experiment settings (Sec. VI).

    ``zeta`` and ``zeta_prime`` are *relative* per-sample times, not seconds:
    only their ratio to each other and to the lambdas matters. The batch size
    (64 in the paper) does not enter the time model: eq. 17 charges ``zeta'``
    per sample per round. ``local_updates`` is ``E``: Theorem 1 counts local
    SGD updates, the experiments train 2 local epochs, and ``E = 2`` (so the
    ``I`` term weighs ``(E-1)^2 L^2CG^2 = 1``) is what reproduces the paper:
    with it the largest client after DAFL grows 4.13 / 1.00 / 1.00 / 1.30 /
    1.00 / 1.48 times on D1-D6, against per-round training times (DAFL over
    no correction, Table IV) of 3.97 / 0.96 / 1.01 / 1.29 / 1.00 / 1.41; a
    weight of 100 would give 4.1 / 5.1 / 1.7 / 4.6 / 5.2 / 1.5.
    """

    lambda1: float = 1.0
    """Weight of the estimated training time ``T_t`` in ``P``."""
    lambda2: float = 100.0
    """Weight of the estimated augmentation time ``T_a`` in ``P`` (paper: 1e2, 1e3, 1e4)."""
    tau: float = 1e-3
    """Largest tolerated global class imbalance ``J`` after augmentation."""
    epsilon: float = 1e-3
    """Bound on the ``I``-dependent term of the convergence bound; rounds ~ ``(1 + ...)/epsilon``."""
    step: int = 1
    """``s``: samples added per greedy step. Larger is faster and coarser."""
    zeta: float = 1.0
    """Relative time for a client to augment one sample (eq. 16)."""
    zeta_prime: float = 2.0
    """Relative time for a client to train on one sample, per round (eq. 17)."""
    local_updates: int = 2
    """``E``, local updates (epochs in the experiments) per round, entering ``T_t`` as ``(E-1)^2``."""
    smoothness: float = 1.0
    """``L^2 C G^2``, an unknown scale the paper sets to 1."""

    def __post_init__(self) -> None:
        for name in ("lambda1", "lambda2", "tau", "zeta", "zeta_prime", "smoothness"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {self.epsilon!r}")
        _check_step(self.step, self.tau)
        if isinstance(self.local_updates, bool) or not isinstance(self.local_updates, int):
            raise TypeError(f"local_updates must be an integer, got {self.local_updates!r}")
        if self.local_updates < 1:
            raise ValueError(f"local_updates must be >= 1, got {self.local_updates}")

    @property
    def drift_weight(self) -> float:
        """``(E-1)^2 L^2 C G^2``, the factor in front of ``I`` in ``T_t``."""
        return (self.local_updates - 1) ** 2 * self.smoothness

    def objective(self, counts: ArrayLike, augmentation: ArrayLike) -> float:
        """``P = lambda1 * T_t + lambda2 * T_a`` of ``A`` for ``N``, from the definitions."""
        return _objective(
            counts,
            augmentation,
            lambda1=self.lambda1,
            lambda2=self.lambda2,
            zeta=self.zeta,
            zeta_prime=self.zeta_prime,
            epsilon=self.epsilon,
            local_updates=self.local_updates,
            smoothness=self.smoothness,
        )


@dataclass(frozen=True, eq=False)
class AugmentationPlan:
    """What a planner decided, with the imbalance it leaves behind.

    ``A[k, c]`` is the number of extra samples of class ``c`` that client ``k``
    must create; the server sends row ``k`` to client ``k``. ``A`` is read-only
    (and equality is identity: an array field has no single truth value).
    """

    A: NDArray[np.int64] = field(repr=False)
    method: Literal["dafl", "lb"]
    I_before: float
    J_before: float
    I_after: float
    J_after: float
    added: int
    added_per_client: tuple[int, ...]
    plan_seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, used by the CLI's ``--json``."""
        return {
            "method": self.method,
            "I_before": self.I_before,
            "J_before": self.J_before,
            "I_after": self.I_after,
            "J_after": self.J_after,
            "added": self.added,
            "added_per_client": list(self.added_per_client),
            "plan_seconds": self.plan_seconds,
            "A": self.A.tolist(),
        }


def validate_counts(counts: ArrayLike) -> NDArray[np.int64]:
    """Check that ``N`` can be planned for, and return it as int64.

    Beyond :func:`~felix.data.imbalance.as_count_matrix`, every class needs at
    least one sample somewhere: augmentation cannot create a class, and without
    it the imbalance target is unreachable.
    """
    n_mat = as_count_matrix(counts)
    missing = np.flatnonzero(n_mat.sum(axis=0) == 0)
    if missing.size:
        raise ValueError(f"class {missing[0]} has no samples on any client; it cannot be augmented")
    return n_mat


def plan_dafl(counts: ArrayLike, params: DaflParams | None = None) -> AugmentationPlan:
    """Run Algorithm 1 of the paper on ``N`` (see the module docstring for the rules)."""
    params = DaflParams() if params is None else params
    n_mat = validate_counts(counts)
    start = time.perf_counter()
    greedy = _ScalarGreedy if np.count_nonzero(n_mat.sum(axis=1)) * n_mat.shape[1] <= SCALAR_MAX_CELLS else _Greedy
    augmentation = greedy(n_mat, params).run()
    seconds = time.perf_counter() - start
    return _summarise(n_mat, augmentation, "dafl", seconds)


def plan_local_balancing(counts: ArrayLike, tau: float = 1e-3, *, step: int = 1) -> AugmentationPlan:
    """The LB baseline: each client augments alone until its own ``J_k <= tau``.

    A client repeatedly adds ``step`` samples to its locally rarest class
    (lowest class index among equals), the move that lowers ``J_k`` most, as
    prior work balances each local dataset regardless of the others. Clients
    without samples take no part. A client missing a class entirely cannot
    balance itself by class-preserving augmentation, so that is an error.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    _check_step(step, tau)
    n_mat = validate_counts(counts)
    start = time.perf_counter()
    augmentation = np.zeros_like(n_mat)
    for k, row in enumerate(n_mat):
        if row.sum() == 0:
            continue
        absent = np.flatnonzero(row == 0)
        if absent.size:
            raise ValueError(
                f"client {k} has no samples of class {absent[0]}: local balancing cannot reach "
                f"J_k <= tau by class-preserving augmentation"
            )
        events = _water_fill(row, step, tau)
        augmentation[k] = step * np.bincount(events, minlength=row.size)
    seconds = time.perf_counter() - start
    return _summarise(n_mat, augmentation, "lb", seconds)


def _check_step(step: int, tau: float) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {step!r}")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if tau == 0 and step != 1:
        raise ValueError("tau = 0 needs step = 1: with larger steps exact balance may be unreachable")


def _summarise(
    n_mat: NDArray[np.int64], augmentation: NDArray[np.int64], method: Literal["dafl", "lb"], seconds: float
) -> AugmentationPlan:
    augmentation.setflags(write=False)
    augmented = n_mat + augmentation
    per_client = augmentation.sum(axis=1)
    return AugmentationPlan(
        A=augmentation,
        method=method,
        I_before=label_proportion_imbalance(n_mat),
        J_before=global_class_imbalance(n_mat),
        I_after=label_proportion_imbalance(augmented),
        J_after=global_class_imbalance(augmented),
        added=int(per_client.sum()),
        added_per_client=tuple(int(v) for v in per_client),
        plan_seconds=seconds,
    )


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


class _ScalarGreedy(_GreedySetup):
    """:class:`_Greedy` for small ``N``, on Python floats instead of numpy arrays.

    Same state, same formulas, same order of floating-point operations, hence the
    same decisions bit for bit (``tests/test_dafl_planner.py`` runs both on the same
    matrices). On the paper's 8 x 8 matrices numpy's per-call overhead is most of a
    step, and the greedy cannot be batched: at ``s = 1`` its choices form no runs
    (D2: 24,903 changes of (client, class) in 24,913 steps), consecutive Phase 1
    levels rarely repeat, and predicting a block of steps and checking it at once
    fails at about every step. What keeps a scalar step short:

    * Phase 1 candidates share one class total, so a client's best candidate is its
      smallest count among the tied classes: each client keeps its candidate classes
      sorted by (count, class) and a cursor on its first tied one; the tied set only
      shrinks within a level, so cursors only move forward;
    * in Phase 2 only the few classes that keep ``J <= tau`` are scanned;
    * per-client terms are updated only for the client that grew.
    """

    def __init__(self, n_mat: NDArray[np.int64], params: DaflParams) -> None:
        counts = self._setup(n_mat, params)
        s = self.step

        self.counts: list[list[float]] = counts.astype(np.float64).tolist()  # N + A, exact while < 2**53
        self.added = np.zeros_like(counts)
        self.candidate = (counts > 0).tolist()  # class-preserving: no new classes
        # Each client's candidate classes sorted by (count, class).
        self.order = [sorted(np.flatnonzero(row > 0).tolist(), key=lambda c, r=row: (r[c], c)) for row in counts]
        self.sizes = [float(v) for v in counts.sum(axis=1)]  # n_k + a_k
        self.aug_sizes = [0.0] * len(self.rows)  # a_k
        self.squares = [float(v) for v in np.einsum("kc,kc->k", counts, counts)]  # Q_k
        self.totals = [int(v) for v in counts.sum(axis=0)]  # n^(c)
        self.n = sum(self.totals)
        self.s2 = sum(t * t for t in self.totals)
        self.max_size = max(self.sizes)
        self.max_aug = 0.0
        self.ratio = [q / n for q, n in zip(self.squares, self.sizes)]
        self.delta = [(q + s * s) / (n + s) - r for q, n, r in zip(self.squares, self.sizes, self.ratio)]
        self.width_if_grown = [self.alpha * (n + s) for n in self.sizes]
        self.aug_if_grown = [self.beta * (a + s) for a in self.aug_sizes]
        self.width = [max(w, self.alpha * self.max_size) for w in self.width_if_grown]
        self.extra = [max(e, self.beta * self.max_aug) for e in self.aug_if_grown]

    def run(self) -> NDArray[np.int64]:
        self._phase1()
        self._phase2()
        full = np.zeros(self.full_shape, dtype=np.int64)
        full[self.rows] = self.added
        return full

    def _phase1(self) -> None:
        """``_Greedy._phase1`` with the per-client cursors of the class docstring."""
        s = self.step
        phase1 = _water_fill(np.array(self.totals), s, self.tau).size
        counts, order, sizes, delta, width, extra = (
            self.counts, self.order, self.sizes, self.delta, self.width, self.extra)
        k_range = range(len(counts))
        cursor = [0] * len(counts)  # position in order[k] of the client's first tied class
        first = [-1] * len(counts)  # that class; -1: the client has none
        scaled = [math.inf] * len(counts)  # x / (n_k + s) of that class; inf: none
        tied: list[bool] = []
        level = n_tied = 0
        for _ in range(phase1):
            if n_tied == 0:  # a new level: the classes at the lowest total
                level = min(self.totals)
                tied = [t == level for t in self.totals]
                n_tied = sum(tied)
                stale = k_range
                for k in k_range:
                    cursor[k] = 0
            for j in stale:
                row, i = order[j], cursor[j]
                for c in row[i:]:
                    if tied[c]:
                        cursor[j], first[j], scaled[j] = i, c, counts[j][c] / (sizes[j] + s)
                        break
                    i += 1
                else:
                    first[j], scaled[j] = -1, math.inf
            inv = 1.0 / (self.n + s)
            kappa_n = self.kappa * inv
            shared = 1.0 + kappa_n * (math.fsum(self.ratio) - (self.s2 + s * s) * inv)
            slope = 2 * s * kappa_n
            offset = level * inv
            values = [w * (d * kappa_n + shared + slope * (h - offset)) + e if h < math.inf else math.inf
                      for w, d, h, e in zip(width, delta, scaled, extra)]
            best = min(values)
            threshold = best + P_RTOL * best
            k = 0
            while not values[k] <= threshold:
                k += 1
            row = order[k]
            if width[k] * slope > 0:
                limit = ((threshold - extra[k]) / width[k] - (delta[k] * kappa_n + shared)) / slope
                x_row, size = counts[k], sizes[k] + s
                c = min(c for c in row if tied[c] and x_row[c] / size - offset <= limit)
            else:
                c = min(c for c in row if tied[c])
            self._add(k, c)
            tied[c] = False
            n_tied -= 1
            cursor[k] = 0  # its classes were re-sorted
            stale = [j for j, f in enumerate(first) if f == c or j == k]

    def _phase2(self) -> None:
        """``_Greedy._phase2``, scanning only the feasible classes."""
        s = self.step
        p, q = self.tau.as_integer_ratio()
        n_classes = self.n_classes
        counts, candidate, sizes, delta, width, extra = (
            self.counts, self.candidate, self.sizes, self.delta, self.width, self.extra)
        k_range = range(len(counts))
        current = self._objective()
        while True:
            n1 = self.n + s
            # J' <= p/q  <=>  2 s q C g <= p C n1^2 + q n1^2 - q C (S2 + s^2), g the class total
            bound = (p * n_classes * n1 * n1 + q * n1 * n1 - q * n_classes * (self.s2 + s * s)) // (
                2 * s * q * n_classes)
            feasible = [c for c, t in enumerate(self.totals) if t <= bound]
            if not feasible:
                break
            inv = 1.0 / n1
            kappa_n = self.kappa * inv
            shared = 1.0 + kappa_n * (math.fsum(self.ratio) - (self.s2 + s * s) * inv)
            slope = 2 * s * kappa_n
            offsets = [self.totals[c] * inv for c in feasible]
            values = []
            for k in k_range:
                x_row, cand, size = counts[k], candidate[k], sizes[k] + s
                h = math.inf
                for c, o in zip(feasible, offsets):
                    if cand[c] and x_row[c] / size - o < h:
                        h = x_row[c] / size - o
                values.append(width[k] * (delta[k] * kappa_n + shared + slope * h) + extra[k]
                              if h < math.inf else math.inf)
            best = min(values)
            threshold = best + P_RTOL * best
            k = 0
            while not values[k] <= threshold:
                k += 1
            x_row, cand, size = counts[k], candidate[k], sizes[k] + s
            inner = delta[k] * kappa_n + shared
            hs = [(c, x_row[c] / size - o) for c, o in zip(feasible, offsets) if cand[c]]
            if width[k] * slope > 0:
                limit = ((threshold - extra[k]) / width[k] - inner) / slope
                c, h = next((c, h) for c, h in hs if h <= limit)
            else:
                c, h = hs[0]
            value = width[k] * (inner + slope * h) + extra[k]
            if not value < current - P_RTOL * current:
                break
            self._add(k, c)
            current = value

    def _objective(self) -> float:
        """P of the current state."""
        imbalance = math.fsum(self.ratio) / self.n - self.s2 / self.n**2
        return self.alpha * self.max_size * (1.0 + self.kappa * imbalance) + self.beta * self.max_aug

    def _add(self, k: int, c: int) -> None:
        s = self.step
        x_row = self.counts[k]
        x = x_row[c]
        x_row[c] = x + s
        self.added[k, c] += s
        order = self.order[k]
        i = order.index(c)  # move c right past the classes now below it in (count, class) order
        last = len(order) - 1
        while i < last and (x_row[order[i + 1]], order[i + 1]) < (x + s, c):
            order[i] = order[i + 1]
            i += 1
        order[i] = c
        squares = self.squares[k] = self.squares[k] + 2 * s * x + s * s
        size = self.sizes[k] = self.sizes[k] + s
        aug = self.aug_sizes[k] = self.aug_sizes[k] + s
        total = self.totals[c] = self.totals[c] + s
        self.n += s
        self.s2 += 2 * s * (total - s) + s * s
        ratio = self.ratio[k] = squares / size
        self.delta[k] = (squares + s * s) / (size + s) - ratio
        grown = self.width_if_grown[k] = self.alpha * (size + s)
        aug_grown = self.aug_if_grown[k] = self.beta * (aug + s)
        if size > self.max_size:
            self.max_size = size
            self.width[:] = [max(w, self.alpha * size) for w in self.width_if_grown]  # in place: loops hold it
        else:
            self.width[k] = max(grown, self.alpha * self.max_size)
        if aug > self.max_aug:
            self.max_aug = aug
            self.extra[:] = [max(e, self.beta * aug) for e in self.aug_if_grown]
        else:
            self.extra[k] = max(aug_grown, self.beta * self.max_aug)
