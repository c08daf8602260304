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
* ``J`` ties. After ``s`` more samples the total is the same whichever pair is
  chosen, so the ``J`` of a candidate is a function of its class's global count
  alone, smaller count meaning lower ``J``: Phase 1 always augments one of the
  globally rarest classes, and those tie exactly (decided on integers), broken by P.
* The rule (``DaflParams.rule``) for the rest:

  - ``"float"`` (default; reproduces the paper's Table III, see ``docs/dafl.md``):
    ``J <= tau`` is decided on ``J = sum_c (n^(c)/n - 1/C)^2`` evaluated in
    float64, in class order (``felix.strategies.dataplans.imbalance.global_class_imbalance``, so
    the reported ``J_after`` always passes the test), against the float ``tau``;
    the P of every candidate is evaluated (formula below) and the strict argmin
    wins, the first pair in row-major order (lowest client, then lowest class)
    among exactly equal values; Phase 2 accepts a move only if its P is strictly
    below the current P. Integer counts hit ``J == tau`` exactly (``J = 1/1000``
    at step 12,509 of D3 with lambda2 = 100), where the float ``J`` is a hair
    above ``tau``, so the move is refused, as in the paper's arithmetic.
  - ``"exact"``: ``J <= tau`` is decided exactly, on integers, with ``tau`` at its
    binary value; P values within ``P_RTOL`` (relative) of the smallest count as
    tied (first pair in row-major order wins), and Phase 2 only accepts a move
    that lowers P by more than ``P_RTOL * P``. This is the planner's rule before
    the compiled kernel, and plans identically to it.

How P is evaluated. ``I = (1/n) sum_k Q_k / n_k - S2 / n^2`` with
``Q_k = sum_c (n_k^(c))^2`` and ``S2 = sum_c (n^(c))^2``, so the P after adding
``s`` to ``(k, c)`` is ``width_k * (inner_k + slope * h_kc) + extra_k`` with
``h_kc = x_kc / (n_k + s) - n^(c) / (n + s)``, a per-client term plus one
``K x C`` matrix of which one row changes per step; ``max_k`` in ``T_t`` and
``T_a`` after the move is ``max(old max, new row)``; the sum of the ``Q_k / n_k``
is correctly rounded (``math.fsum``), so independent of summation order.

Speed and bounds. The greedy loop runs compiled (:mod:`felix.strategies.dataplans.dafl_kernel`,
numba): 1-12 ms per Table II case. The work is bounded before it starts: a cell
above ``MAX_COUNT`` is an error naming the cell; a matrix whose samples (with the
additions) could exceed ``max_total_samples(C)`` is refused, because the exact
integer arithmetic needs ``C * n^2 < 2^62``; a plan that needs more than
``max_steps`` greedy steps (``MAX_STEPS`` by default) is refused up front when a
lower bound on Phase 1 already exceeds it, and stopped with the same error
otherwise. Nothing proportional to the number of steps is held in memory. With a
``time_budget_s`` the loop reports to a monitor every few milliseconds and stops at the budget, or
earlier when Phase 1's measured speed projects it past the budget (Phase 1's length is known
before it starts); the error then suggests a step that fits.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final, Literal, get_args

import numpy as np
from numpy.typing import ArrayLike, NDArray
from pydantic import Field, model_validator

from felix.config import DaflPlannerCfg
from felix.strategies.dataplans.imbalance import (
    MAX_COUNT,
    as_count_matrix,
    global_class_imbalance,
    label_proportion_imbalance,
)
from felix.strategies.dataplans.imbalance import objective as _objective

__all__ = [
    "MAX_COUNT",
    "MAX_STEPS",
    "P_RTOL",
    "RULES",
    "AugmentationPlan",
    "DaflParams",
    "PlanProgress",
    "PlanTooLargeError",
    "max_total_samples",
    "phase1_steps",
    "plan_dafl",
    "plan_local_balancing",
    "provably_tiny",
    "step_upper_bound",
    "validate_counts",
]

#: Relative tolerance under which two values of the objective P count as equal (rule "exact").
P_RTOL: Final = 1e-12

#: The rules for ``J <= tau`` and P ties (module docstring); the first is the default.
Rule = Literal["float", "exact"]
RULES: Final = get_args(Rule)

#: Default bound on greedy steps per plan. It bounds the work, not the wait: a step costs O(K) in
#: Phase 1 and O(K x C) in Phase 2, about 40 us compiled at 1000 clients x 100 classes, so 10^7
#: steps there are 4-15 minutes (interpreted, hours). ``plan_dafl``'s ``time_budget_s`` (the CLI's
#: ``--time-budget``, 60 s by default) is what bounds the time.
MAX_STEPS: Final = 10_000_000


class PlanTooLargeError(ValueError):
    """The plan would need more greedy steps, or more samples, than the planner's bounds."""


def max_total_samples(n_classes: int) -> int:
    """Largest number of samples (``N`` plus additions) the planner handles with ``C`` classes:
    its exact integer arithmetic needs ``C * n^2 < 2^62``."""
    return math.isqrt((2**62 - 1) // n_classes)


class DaflParams(DaflPlannerCfg):
    """The planner's parameters: every constant of Problem 1 and Algorithm 1, as the config's
    ``dafl`` section declares them (``DaflPlannerCfg``, defaults the paper's Sec. VI), and the rule.

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

    rule: Rule = Field(
        "float",
        description="how J <= tau is decided and how P ties are broken: float (J in floating point, "
        "strict argmin of P) reproduces the paper's Table III; exact decides on exact rationals, "
        "P ties within 1e-12",
    )

    @model_validator(mode="after")
    def _step_bound(self) -> DaflParams:
        _check_step(self.step, self.tau)
        return self

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

    Beyond :func:`~felix.strategies.dataplans.imbalance.as_count_matrix` (which names any cell
    above ``MAX_COUNT``), every class needs at least one sample somewhere:
    augmentation cannot create a class, and without it the imbalance target is
    unreachable.
    """
    n_mat = as_count_matrix(counts)
    missing = np.flatnonzero(n_mat.sum(axis=0) == 0)
    if missing.size:
        raise ValueError(f"class {missing[0]} has no samples on any client; it cannot be augmented")
    return n_mat


@dataclass(frozen=True)
class PlanProgress:
    """Where a running DAFL plan stands, passed to ``plan_dafl``'s ``progress`` callback."""

    steps: int
    """Greedy steps taken so far."""
    phase: int
    """1 while ``J > tau`` (its length is known: ``phase1``), 2 while moves still lower P."""
    phase1: int
    """Steps Phase 1 takes in all (known before planning: it depends on the class totals only)."""
    elapsed_s: float
    """Seconds since planning started (what the time budget counts)."""


#: Seconds of Phase 1 after which its measured speed is trusted to project its length.
PROJECT_AFTER_S: Final = 0.5

#: Cell visits (clients x classes per step) between two checks of the budget and progress: a few
#: milliseconds of compiled work, so a check (a call into the interpreter) costs well under 1%.
CHECK_VISITS: Final = 4_000_000


def plan_dafl(
    counts: ArrayLike,
    params: DaflParams | None = None,
    *,
    max_steps: int = MAX_STEPS,
    time_budget_s: float | None = None,
    progress: Callable[[PlanProgress], None] | None = None,
) -> AugmentationPlan:
    """Run Algorithm 1 of the paper on ``N`` (see the module docstring for the rules and bounds).

    Raises :class:`PlanTooLargeError` when the plan needs more than ``max_steps`` greedy steps
    (use a larger ``step``) or more samples than :func:`max_total_samples`, and, with a
    ``time_budget_s``, as soon as Phase 1's measured speed projects it past the budget (after
    ``PROJECT_AFTER_S``; the message suggests a step that fits) or the plan runs past it.
    ``progress`` is called every few milliseconds of planning with a :class:`PlanProgress`.
    """
    params = DaflParams() if params is None else params
    _check_max_steps(max_steps)
    if time_budget_s is not None and not (math.isfinite(time_budget_s) and time_budget_s > 0):
        raise ValueError(f"time budget must be a finite number of seconds > 0, got {time_budget_s!r}")
    n_mat = validate_counts(counts)
    kernel = _load_kernel()
    rule = _rule_code(kernel, params.rule)
    start = time.perf_counter()
    totals = n_mat.sum(axis=0)
    phase1 = phase1_steps(totals, params.step, params.tau, rule=params.rule, max_steps=max_steps)
    limit = max_total_samples(n_mat.shape[1])
    _check_total(int(totals.sum()) + phase1 * params.step, limit, "after Phase 1")
    rows = np.flatnonzero(n_mat.sum(axis=1) > 0)
    watch = _Watch(start, phase1, params.step, time_budget_s, progress)
    check_every = 0
    if time_budget_s is not None or progress is not None:
        check_every = max(1, CHECK_VISITS // (rows.size * n_mat.shape[1]))
    with kernel.monitor(watch):
        added = kernel.greedy(
            n_mat[rows],
            params.step,
            params.tau,
            params.lambda1 * params.zeta_prime / params.epsilon,
            params.lambda2 * params.zeta,
            params.drift_weight,
            rule,
            P_RTOL,
            max_steps,
            limit,
            check_every,
        )
    if added[0, 0] < 0:
        if added[0, 0] == kernel.STOPPED:
            raise PlanTooLargeError(watch.reason)
        _stopped(int(added[0, 0]), max_steps, limit, params.step)
    augmentation = np.zeros_like(n_mat)
    augmentation[rows] = added
    seconds = time.perf_counter() - start
    return _summarise(n_mat, augmentation, "dafl", seconds)


@dataclass
class _Watch:
    """The monitor of one plan: reports progress and stops the greedy loop at the time budget.

    Phase 1's length is known, so its speed, measured from the loop's first check over at least
    ``PROJECT_AFTER_S`` (what comes before, the water-fill that counts Phase 1 and the loop's own
    start, is spent time, not a rate), projects when it will end; Phase 2's length is not known (its
    moves continue while P falls), so there only the budget itself stops it. The step suggested
    scales the step by four times the projected overrun: the number of steps falls in proportion to
    the step but the time per step does not stay the same (measured on the 5,000 x 100 table of
    ``benchmarks/dafl_cli.py``: 6x fewer Phase 1 steps took 2.6x less time), and Phase 2 (on random
    tables about as many steps as Phase 1, each scanning every cell) needs room of its own.
    """

    start: float
    """When planning started (the budget counts from here)."""
    phase1: int
    step: int
    budget_s: float | None
    progress: Callable[[PlanProgress], None] | None
    reason: str = ""
    mark: tuple[float, int] | None = None
    """Time and step of the loop's first check: Phase 1's speed is measured from there."""

    def __call__(self, steps: int, phase: int) -> bool:
        now = time.perf_counter()
        elapsed = now - self.start
        if self.progress is not None:
            self.progress(PlanProgress(steps, phase, self.phase1, elapsed))
        if self.budget_s is None:
            return False
        if self.mark is None:
            self.mark = (now, steps)
        measured, done = now - self.mark[0], steps - self.mark[1]
        if phase == 1 and done > 0 and measured >= min(PROJECT_AFTER_S, self.budget_s / 10):
            projected = elapsed + (self.phase1 - steps) * measured / done
            if projected > self.budget_s:
                self.reason = (
                    f"Phase 1 alone would take about {projected:,.0f} s ({self.phase1:,} greedy steps at "
                    f"step {self.step}, {done:,} in {measured:.1f} s), above the time budget of "
                    f"{self.budget_s:g} s: use a step of at least {self._suggest(projected)} samples, "
                    f"or a larger budget"
                )
                return True
        if elapsed > self.budget_s:
            self.reason = (
                f"planning passed the time budget of {self.budget_s:g} s after {steps:,} greedy steps at "
                f"step {self.step} (Phase {phase}; Phase 1 has {self.phase1:,}): use a step of at "
                f"least {self._suggest(max(elapsed, self.budget_s))} samples, or a larger budget"
            )
            return True
        return False

    def _suggest(self, projected_s: float) -> int:
        assert self.budget_s is not None
        return min(MAX_COUNT, math.ceil(self.step * 4 * projected_s / self.budget_s))


def phase1_steps(
    totals: ArrayLike, step: int, tau: float, *, rule: str = "float", max_steps: int = MAX_STEPS
) -> int:
    """Greedy steps of Phase 1 for class totals ``totals``: it depends on nothing else, because
    every Phase 1 step adds ``step`` to one of the rarest classes (a water-fill). Raises
    :class:`PlanTooLargeError` when more than ``max_steps`` would be needed."""
    return int(_water_fill(np.asarray(totals, dtype=np.int64), step, tau, rule, max_steps).sum())


def _water_fill(
    totals: NDArray[np.int64], step: int, tau: float, rule: str, max_steps: int
) -> NDArray[np.int64]:
    """Steps per class of the water-fill of ``totals`` to ``J <= tau``, refused up front when a
    lower bound already exceeds ``max_steps``: the largest class keeps at least its count, so
    ``J <= tau`` needs ``n' >= max_c n^(c) / (1/C + sqrt(tau))`` samples."""
    n_classes, n0, top = totals.size, int(totals.sum()), int(totals.max())
    limit = max_total_samples(n_classes)
    needed = math.ceil(top / (1.0 / n_classes + math.sqrt(tau)))
    lower = max(0, -(-(needed - n0) // step))
    if lower > max_steps:
        raise PlanTooLargeError(
            f"balancing these counts to J <= {tau:g} needs at least {lower:,} greedy steps of {step} "
            f"samples (largest class total {top:,} of {n0:,}), above the bound of {max_steps:,} steps: "
            f"use a step of at least {-(-lower * step // max_steps):,} samples"
        )
    _check_total(max(n0, needed), limit, "after balancing")
    kernel = _load_kernel()
    events = kernel.water_fill(totals, step, tau, _rule_code(kernel, rule), max_steps, limit)
    if events[0] < 0:
        raise PlanTooLargeError(
            f"balancing these counts to J <= {tau:g} needs more than {max_steps:,} greedy steps of {step} "
            f"samples (or more than {limit:,} samples): use a larger step"
        )
    return events


def plan_local_balancing(
    counts: ArrayLike, tau: float = 1e-3, *, step: int = 1, rule: str = "float", max_steps: int = MAX_STEPS
) -> AugmentationPlan:
    """The LB baseline: each client augments alone until its own ``J_k <= tau``.

    A client repeatedly adds ``step`` samples to its locally rarest class
    (lowest class index among equals), the move that lowers ``J_k`` most, as
    prior work balances each local dataset regardless of the others. Clients
    without samples take no part. A client missing a class entirely cannot
    balance itself by class-preserving augmentation, so that is an error.
    ``rule`` decides ``J_k <= tau`` as for DAFL; ``max_steps`` bounds each client.
    """
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0, got {tau!r}")
    _check_step(step, tau)
    _check_max_steps(max_steps)
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    n_mat = validate_counts(counts)
    _load_kernel()
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
        try:
            augmentation[k] = step * _water_fill(row, step, tau, rule, max_steps)
        except PlanTooLargeError as exc:
            raise PlanTooLargeError(f"client {k}: {exc}") from None
    seconds = time.perf_counter() - start
    return _summarise(n_mat, augmentation, "lb", seconds)


@functools.cache
def _load_kernel() -> ModuleType:
    """The numba kernel, imported on first use (so that importing this module, e.g. for the CLI's
    parser, costs no numba start-up), then loaded (or, the first time after installation,
    compiled) once per process on a trivial matrix, so that ``plan_seconds`` measures planning and
    not numba's start-up."""
    from felix.strategies.dataplans import dafl_kernel

    dafl_kernel.greedy(
        np.ones((1, 2), dtype=np.int64), 1, 1e-3, 1.0, 1.0, 1.0, dafl_kernel.RULE_FLOAT, P_RTOL, 1, 4, 0
    )
    dafl_kernel.water_fill(np.ones(2, dtype=np.int64), 1, 1e-3, dafl_kernel.RULE_FLOAT, 1, 4)
    return dafl_kernel


def _rule_code(kernel: ModuleType, rule: str) -> int:
    return int(kernel.RULE_FLOAT if rule == "float" else kernel.RULE_EXACT)


def step_upper_bound(counts: ArrayLike, params: DaflParams | None = None) -> int:
    """An upper bound on the greedy steps of ``plan_dafl(counts, params)``, from numpy alone.

    Phase 1 is a water-fill of the class totals (module docstring). Filling every class up to the
    largest total ``m`` takes ``sum_c ceil((m - n^(c)) / s)`` steps; from then on the totals stay
    within ``s`` of each other, so ``J <= C s^2 / n^2``, which is ``<= tau`` once
    ``n >= s sqrt(C / tau)`` (one more round of ``C`` steps per ``C s`` samples short of it).
    Phase 2 accepts only moves that lower P below its value at the end of Phase 1, ``P1``, and P is at
    least ``alpha * max_k (n_k + a_k) + beta * max_k a_k`` (``alpha = lambda1 zeta' / epsilon``,
    ``beta = lambda2 zeta``; ``I >= 0``), so each client's additions stay below both
    ``P1 / beta`` and ``P1 / alpha - n_k``; ``P1`` itself is at most
    ``alpha (max_k n_k + a) (1 + kappa) + beta a`` with ``a`` Phase 1's additions (``I <= 1``).
    The bound is loose (for Table II's D3 at lambda2 = 100, millions against 39,060), which is what
    it is for: proving that a table is tiny, never estimating a run's length.
    """
    params = DaflParams() if params is None else params
    n_mat = validate_counts(counts)
    n_mat = n_mat[n_mat.sum(axis=1) > 0]
    s = params.step
    phase1 = _fill_upper_bound(n_mat.sum(axis=0), s, params.tau)
    added = phase1 * s
    alpha = params.lambda1 * params.zeta_prime / params.epsilon
    beta = params.lambda2 * params.zeta
    sizes = n_mat.sum(axis=1)
    p_end = (alpha * (int(sizes.max()) + added) * (1 + params.drift_weight) + beta * added) * (1 + 1e-6)
    per_client = np.full(sizes.size, math.inf)
    if beta > 0:
        per_client = np.minimum(per_client, p_end / beta)
    if alpha > 0:
        per_client = np.minimum(per_client, p_end / alpha - sizes)
    if math.isinf(float(per_client.max())):  # alpha = beta = 0: P is 0, Phase 2 never moves
        return phase1
    return phase1 + int(np.floor(np.maximum(per_client, 0) / s).sum()) + int(sizes.size)


def _fill_upper_bound(totals: NDArray[np.int64], s: int, tau: float) -> int:
    """Upper bound on the steps of the water-fill of ``totals`` to ``J <= tau`` (see
    :func:`step_upper_bound`)."""
    classes = totals.size
    top = int(totals.max())
    steps = sum(-(-(top - int(t)) // s) for t in totals.tolist()) + classes
    if tau > 0:
        reached = int(totals.sum()) + steps * s
        needed = s * math.sqrt(classes / tau) * (1 + 1e-6) + 1
        steps += classes * math.ceil(max(0.0, needed - reached) / (classes * s))
    return steps


def provably_tiny(
    counts: ArrayLike,
    params: DaflParams | None = None,
    *,
    method: Literal["dafl", "lb"] = "dafl",
    visits: int = 1_000_000,
) -> bool:
    """Whether the plan visits at most ``visits`` cells (clients x classes per greedy step of DAFL,
    by :func:`step_upper_bound`; classes per water-fill step of each LB client): about 0.2 s
    interpreted, less than numba needs to load the compiled kernel. Only a process that plans once
    may act on it (the CLI)."""
    params = DaflParams() if params is None else params
    n_mat = validate_counts(counts)
    n_mat = n_mat[n_mat.sum(axis=1) > 0]
    classes = n_mat.shape[1]
    if method == "lb":
        work = sum(classes * _fill_upper_bound(row, params.step, params.tau) for row in n_mat if row.all())
        return work <= visits
    return n_mat.shape[0] * classes * step_upper_bound(n_mat, params) <= visits


def _check_step(step: int, tau: float) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {step!r}")
    if not 1 <= step <= MAX_COUNT:
        raise ValueError(f"step must be between 1 and {MAX_COUNT}, got {step}")
    if tau == 0 and step != 1:
        raise ValueError("tau = 0 needs step = 1: with larger steps exact balance may be unreachable")


def _check_max_steps(max_steps: int) -> None:
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= 2**62:
        raise ValueError(f"max_steps must be an integer between 1 and 2^62, got {max_steps!r}")


def _check_total(total: int, limit: int, when: str) -> None:
    if total > limit:
        raise PlanTooLargeError(
            f"the plan would hold {total:,} samples {when}, above the planner's maximum of {limit:,} "
            f"for this many classes (its exact integer arithmetic needs C * n^2 < 2^62)"
        )


def _stopped(code: int, max_steps: int, limit: int, step: int) -> None:
    if code == -1:
        raise PlanTooLargeError(
            f"planning stopped after {max_steps:,} greedy steps of {step} samples "
            f"(the bound): use a larger step"
        )
    raise PlanTooLargeError(
        f"planning stopped at the planner's maximum of {limit:,} samples "
        f"(its exact integer arithmetic needs C * n^2 < 2^62)"
    )


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
