"""The compiled inner loop of the DAFL planner (Algorithm 1), and the water-fill of local balancing.

Every greedy step depends on the previous one, so the only way to make the paper's 25-40k steps
per 8 x 8 case cheap is to run the loop without the interpreter: the functions here are compiled
by numba (``nopython``, no fast-math, so floating-point operations happen in the order written,
without contraction into fused multiply-adds). :mod:`felix.strategies.dataplans.dafl` validates the input, picks
the rule and bounds the work; this module only plans. The state and formulas are those described
in :mod:`felix.strategies.dataplans.dafl`; the two rules (``RULE_FLOAT``, ``RULE_EXACT``) differ only where the
module docstring there says.

Integers (class totals, ``n``, ``S2``, client sizes, ``Q_k``) are int64; the caller guarantees
that they stay below ``2**62`` (``C * n^2`` included), so no operation here can overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import numpy as np
from numba import njit, objmode

__all__ = [
    "RULE_EXACT",
    "RULE_FLOAT",
    "STOPPED",
    "fsum",
    "greedy",
    "j_float",
    "monitor",
    "msum_add",
    "msum_round",
    "water_fill",
]

#: ``J <= tau`` in floating point, strict argmin of P (the default; see felix.strategies.dataplans.dafl).
RULE_FLOAT: Final = 0
#: ``J <= tau`` in exact arithmetic, P ties within a relative ``P_RTOL``.
RULE_EXACT: Final = 1

#: ``greedy``'s ``[0, 0]`` when the monitor (:func:`monitor`) asked it to stop.
STOPPED: Final = -3

#: Relative band around ``tau`` inside which the cheap float test of ``J <= tau`` is not trusted
#: and the rule's own evaluation decides. Far above the float error of the cheap test (~1e-15).
_NEAR: Final = 1e-9

#: Room for the partials of an exact float sum: non-overlapping doubles span at most
#: 2098 bits (the float64 exponent range plus the mantissa), 40 partials of 53 bits.
_PARTIALS: Final = 64


#: The callback ``greedy`` calls every ``check_every`` steps (from object mode), as
#: ``callback(steps, phase) -> stop``; a list so that the compiled code refers to one fixed global
#: and the caller (``felix.strategies.dataplans.dafl``) can swap what it holds per plan.
_MONITORS: list[Callable[[int, int], bool]] = []


@contextmanager
def monitor(callback: Callable[[int, int], bool]) -> Iterator[None]:
    """Route ``greedy``'s periodic checks to ``callback`` while the block runs (one plan at a time
    per process; nested blocks see the innermost)."""
    _MONITORS.append(callback)
    try:
        yield
    finally:
        _MONITORS.pop()


def _check(steps: int, phase: int) -> bool:
    """Object-mode trampoline: True when the current monitor asks the plan to stop."""
    return bool(_MONITORS) and bool(_MONITORS[-1](steps, phase))


@njit(cache=True)
def msum_add(partials: np.ndarray, n: int, x: float) -> int:  # pragma: no cover - compiled
    """Add ``x`` exactly to the non-overlapping ``partials[:n]`` (Shewchuk's msum, as CPython's
    ``math.fsum``); returns the new count. The partials hold the exact sum of what was added."""
    i = 0
    for j in range(n):
        y = partials[j]
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo != 0.0:
            partials[i] = lo
            i += 1
        x = hi
    n = i
    if x != 0.0:
        partials[n] = x
        n += 1
    return n


@njit(cache=True)
def msum_round(partials: np.ndarray, n: int) -> float:  # pragma: no cover - compiled
    """The exact sum held in ``partials[:n]``, correctly rounded (CPython's ``math.fsum`` ending)."""
    hi = 0.0
    if n > 0:
        n -= 1
        hi = partials[n]
        lo = 0.0
        while n > 0:
            x = hi
            n -= 1
            y = partials[n]
            hi = x + y
            yr = hi - x
            lo = y - yr
            if lo != 0.0:
                break
        if n > 0 and ((lo < 0.0 and partials[n - 1] < 0.0) or (lo > 0.0 and partials[n - 1] > 0.0)):
            y = lo * 2.0
            x = hi + y
            yr = x - hi
            if y == yr:
                hi = x
    return hi


@njit(cache=True)
def fsum(values: np.ndarray, m: int) -> float:  # pragma: no cover - compiled
    """``math.fsum(values[:m])`` for finite values: correctly rounded."""
    partials = np.empty(_PARTIALS)
    n = 0
    for idx in range(m):
        n = msum_add(partials, n, values[idx])
    return msum_round(partials, n)


@njit(cache=True)
def j_float(totals: np.ndarray, bumped: int, s: int, n: int) -> float:  # pragma: no cover - compiled
    """``J = sum_c (n^(c)/n - 1/C)^2`` in float64, summed in class order, of ``totals`` with ``s``
    added to class ``bumped`` (none when ``bumped < 0``) and ``n`` samples in all."""
    classes = totals.shape[0]
    uniform = 1.0 / classes
    total = 0.0
    nf = float(n)
    for c in range(classes):
        t = totals[c] + s if c == bumped else totals[c]
        d = float(t) / nf - uniform
        total += d * d
    return total


def _exact_le(numerator: int, denominator: int, tau: float) -> bool:
    """``numerator / denominator <= tau`` with ``tau`` at its exact binary value (Python integers)."""
    p, q = tau.as_integer_ratio()
    return numerator * q <= p * denominator


@njit(cache=True)
def _meets_tau(
    totals: np.ndarray, bumped: int, s: int, s2: int, n: int, tau: float, rule: int
) -> bool:  # pragma: no cover - compiled
    """``J <= tau`` for the totals (class ``bumped`` raised by ``s``), whose sum of squares is
    ``s2`` and sum ``n``. A cheap float estimate decides away from ``tau``; near it the rule's
    own evaluation does: exact integers, or ``j_float``."""
    classes = totals.shape[0]
    numerator = classes * s2 - n * n  # J = numerator / (C n^2) exactly
    denominator = classes * n * n
    if tau == 0.0 and rule == RULE_EXACT:
        return numerator <= 0
    estimate = float(numerator) / float(denominator)
    margin = _NEAR * tau + 1e-300
    if estimate < tau - margin - 1e-15:
        return True
    if estimate > tau + margin + 1e-15:
        return False
    if rule == RULE_FLOAT:
        return j_float(totals, bumped, s, n) <= tau
    with objmode(ok="boolean"):
        ok = _exact_le(int(numerator), int(denominator), tau)
    return ok


@njit(cache=True)
def water_fill(
    totals: np.ndarray, s: int, tau: float, rule: int, max_steps: int, max_total: int
) -> np.ndarray:  # pragma: no cover - compiled
    """Additions per class (in units of ``s``) of the water-fill: ``s`` to the rarest class
    (lowest index among equals) until ``J <= tau``. All -1 once more than ``max_steps`` steps or
    ``max_total`` samples would be needed: the work is bounded, and nothing is materialised but
    the per-class counts."""
    classes = totals.shape[0]
    t = totals.copy()
    events = np.zeros(classes, dtype=np.int64)
    n = 0
    s2 = 0
    for c in range(classes):
        n += t[c]
        s2 += t[c] * t[c]
    steps = 0
    while not _meets_tau(t, -1, 0, s2, n, tau, rule):
        if steps == max_steps or n > max_total - s:
            events[:] = -1
            return events
        best = 0
        for c in range(1, classes):
            if t[c] < t[best]:
                best = c
        s2 += 2 * s * t[best] + s * s
        t[best] += s
        n += s
        events[best] += 1
        steps += 1
    return events


@njit(cache=True)
def greedy(
    counts: np.ndarray,
    s: int,
    tau: float,
    alpha: float,
    beta: float,
    kappa: float,
    rule: int,
    p_rtol: float,
    max_steps: int,
    max_total: int,
    check_every: int,
) -> np.ndarray:  # pragma: no cover - compiled
    """Algorithm 1 on ``counts`` (non-empty clients only): the added-sample matrix, or a matrix
    whose ``[0, 0]`` is -1 when more than ``max_steps`` steps, -2 when more than ``max_total``
    samples, would be needed, ``STOPPED`` when the monitor said stop. Every ``check_every`` steps
    (never when 0) the monitor (:func:`monitor`) is asked, from object mode, whether to go on: that
    is how a caller reports progress and keeps a time budget on a loop that runs compiled.

    P after adding ``s`` to ``(k, c)`` is ``width_k * (inner_k + slope * h_kc) + extra_k`` with
    ``h_kc = x_kc / (n_k + s) - n^(c) / (n + s)`` (see felix.strategies.dataplans.dafl for the derivation).
    """
    rows, classes = counts.shape
    x = counts.astype(np.float64)  # N + A, exact while < 2**53
    added = np.zeros((rows, classes), dtype=np.int64)
    sizes = np.zeros(rows, dtype=np.int64)  # n_k + a_k
    squares = np.zeros(rows, dtype=np.int64)  # Q_k
    aug = np.zeros(rows, dtype=np.int64)  # a_k
    totals = np.zeros(classes, dtype=np.int64)  # n^(c)
    for k in range(rows):
        for c in range(classes):
            v = counts[k, c]
            sizes[k] += v
            squares[k] += v * v
            totals[c] += v
    n = 0
    s2 = 0
    for c in range(classes):
        n += totals[c]
        s2 += totals[c] * totals[c]
    max_size = 0
    for k in range(rows):
        max_size = max(max_size, sizes[k])
    max_aug = 0
    ratio = np.empty(rows)  # Q_k / n_k
    delta = np.empty(rows)  # (Q_k + s^2) / (n_k + s) - Q_k / n_k
    width_if_grown = np.empty(rows)  # alpha * (n_k + s)
    aug_if_grown = np.empty(rows)  # beta * (a_k + s)
    width = np.empty(rows)  # alpha * max size after a move on row k
    extra = np.empty(rows)  # beta * max a after a move on row k
    for k in range(rows):
        ratio[k] = float(squares[k]) / float(sizes[k])
        delta[k] = float(squares[k] + s * s) / float(sizes[k] + s) - ratio[k]
        width_if_grown[k] = alpha * float(sizes[k] + s)
        aug_if_grown[k] = beta * float(aug[k] + s)
        width[k] = max(width_if_grown[k], alpha * float(max_size))
        extra[k] = max(aug_if_grown[k], beta * float(max_aug))

    # sum_k Q_k / n_k, correctly rounded (math.fsum), kept exact in partials as rows change.
    partials = np.empty(_PARTIALS)
    n_partials = 0
    for k in range(rows):
        n_partials = msum_add(partials, n_partials, ratio[k])
    ratio_sum = msum_round(partials, n_partials)
    allowed = np.empty(classes, dtype=np.int64)  # the classes a move may touch, ascending
    n_allowed = 0
    # Phase 1 keeps, per row, its smallest count among the tied classes (and that class, -1: none):
    # all tied classes share one total, so that count gives the row's smallest h, and P is
    # non-decreasing in h. Refreshed only for rows that the last move touched.
    row_min = np.empty(rows)
    # Phase 2: x_kc / (n_k + s) per cell (inf where no candidate), refreshed for the row that grew,
    # and n^(c) / (n + s) per class (-inf where not allowed), so h_kc is one subtraction.
    scaled = np.empty((rows, classes))
    for k in range(rows):
        _scale_row(k, counts, x, sizes, s, scaled)
    offsets = np.empty(classes)
    row_arg = np.full(rows, -1, dtype=np.int64)
    h_row = np.empty(rows)
    p_row = np.empty(rows)
    phase = 1
    level = 0
    current = 0.0
    steps = 0
    while True:
        if phase == 1 and _meets_tau(totals, -1, 0, s2, n, tau, rule):
            phase = 2
            imbalance = ratio_sum / float(n) - float(s2) / float(n * n)
            current = alpha * float(max_size) * (1.0 + kappa * imbalance) + beta * float(max_aug)
        inv = 1.0 / float(n + s)
        if phase == 1:  # the rarest classes: exact J ties, broken by P
            if n_allowed == 0:  # a new level
                level = totals[0]
                for c in range(1, classes):
                    level = min(level, totals[c])
                for c in range(classes):
                    if totals[c] == level:
                        allowed[n_allowed] = c
                        n_allowed += 1
                for k in range(rows):
                    _row_min(k, counts, x, allowed, n_allowed, row_min, row_arg)
            offset = float(level) * inv
            for k in range(rows):
                h_row[k] = x[k, row_arg[k]] / float(sizes[k] + s) - offset if row_arg[k] >= 0 else math.inf
        else:  # the classes that keep J <= tau
            n_allowed = 0
            for c in range(classes):
                if _meets_tau(totals, c, s, s2 + 2 * s * totals[c] + s * s, n + s, tau, rule):
                    allowed[n_allowed] = c
                    n_allowed += 1
            if n_allowed == 0:
                break
            offsets[:] = -math.inf
            for i in range(n_allowed):
                offsets[allowed[i]] = float(totals[allowed[i]]) * inv
            for k in range(rows):
                h_min = math.inf
                for c in range(classes):
                    h = scaled[k, c] - offsets[c]
                    h_min = min(h_min, h)
                h_row[k] = h_min
        # ---- P of each row's best candidate
        kappa_n = kappa * inv
        shared = 1.0 + kappa_n * (ratio_sum - float(s2 + s * s) * inv)
        slope = float(2 * s) * kappa_n
        threshold = math.inf
        best_k = -1
        for k in range(rows):
            if h_row[k] < math.inf:
                p_row[k] = width[k] * (delta[k] * kappa_n + shared + slope * h_row[k]) + extra[k]
                if p_row[k] < threshold:
                    threshold = p_row[k]
                    best_k = k
        if rule == RULE_EXACT:  # ties within p_rtol: the first row within the band
            threshold += p_rtol * threshold
            for k in range(rows):
                if h_row[k] < math.inf and p_row[k] <= threshold:
                    best_k = k
                    break
        k = best_k
        size = float(sizes[k] + s)
        inner = delta[k] * kappa_n + shared
        best_c = -1
        if rule == RULE_FLOAT:  # strict argmin: the row's first class at the smallest P
            for i in range(n_allowed):
                c = allowed[i]
                if counts[k, c] > 0 and (
                    width[k] * (inner + slope * (x[k, c] / size - float(totals[c]) * inv)) + extra[k]
                    == threshold
                ):
                    best_c = c
                    break
        else:  # the row's first class within the band, mapped back to h
            limit = math.inf
            if width[k] * slope > 0:
                limit = ((threshold - extra[k]) / width[k] - inner) / slope
            for i in range(n_allowed):
                c = allowed[i]
                if counts[k, c] > 0 and x[k, c] / size - float(totals[c]) * inv <= limit:
                    best_c = c
                    break
        if best_c < 0:  # rounding left no class under the mapped threshold: the row's best h
            for i in range(n_allowed):
                c = allowed[i]
                if counts[k, c] > 0 and x[k, c] / size - float(totals[c]) * inv == h_row[k]:
                    best_c = c
                    break
        best = width[k] * (inner + slope * (x[k, best_c] / size - float(totals[best_c]) * inv)) + extra[k]
        if phase == 2:
            bar = current - p_rtol * current if rule == RULE_EXACT else current
            if not best < bar:
                break
            current = best
        if steps == max_steps:
            added[0, 0] = -1
            return added
        if n > max_total - s:
            added[0, 0] = -2
            return added
        if check_every > 0 and steps > 0 and steps % check_every == 0:
            with objmode(stop="boolean"):
                stop = _check(steps, phase)
            if stop:
                added[0, 0] = STOPPED
                return added
        # ---- the move
        k, c = best_k, best_c
        xv = counts[k, c] + added[k, c]
        x[k, c] = float(xv + s)
        added[k, c] += s
        squares[k] += 2 * s * xv + s * s
        sizes[k] += s
        aug[k] += s
        _scale_row(k, counts, x, sizes, s, scaled)
        s2 += 2 * s * totals[c] + s * s
        totals[c] += s
        n += s
        n_partials = msum_add(partials, n_partials, -ratio[k])
        ratio[k] = float(squares[k]) / float(sizes[k])
        n_partials = msum_add(partials, n_partials, ratio[k])
        ratio_sum = msum_round(partials, n_partials)
        delta[k] = float(squares[k] + s * s) / float(sizes[k] + s) - ratio[k]
        width_if_grown[k] = alpha * float(sizes[k] + s)
        aug_if_grown[k] = beta * float(aug[k] + s)
        if sizes[k] > max_size:
            max_size = sizes[k]
            for j in range(rows):
                width[j] = max(width_if_grown[j], alpha * float(max_size))
        else:
            width[k] = max(width_if_grown[k], alpha * float(max_size))
        if aug[k] > max_aug:
            max_aug = aug[k]
            for j in range(rows):
                extra[j] = max(aug_if_grown[j], beta * float(max_aug))
        else:
            extra[k] = max(aug_if_grown[k], beta * float(max_aug))
        if phase == 1:  # c leaves the tied classes; refresh the rows that used it, and row k
            i = 0
            while allowed[i] != c:
                i += 1
            n_allowed -= 1
            allowed[i:n_allowed] = allowed[i + 1 : n_allowed + 1]
            if n_allowed > 0:
                for j in range(rows):
                    if j == k or row_arg[j] == c:
                        _row_min(j, counts, x, allowed, n_allowed, row_min, row_arg)
        steps += 1
    return added


@njit(cache=True)
def _scale_row(
    k: int, counts: np.ndarray, x: np.ndarray, sizes: np.ndarray, s: int, scaled: np.ndarray
) -> None:  # pragma: no cover - compiled
    """``scaled[k, c] = x_kc / (n_k + s)`` for the candidates of row ``k``, inf elsewhere."""
    size = float(sizes[k] + s)
    for c in range(counts.shape[1]):
        scaled[k, c] = x[k, c] / size if counts[k, c] > 0 else math.inf


@njit(cache=True)
def _row_min(
    k: int,
    counts: np.ndarray,
    x: np.ndarray,
    allowed: np.ndarray,
    n_allowed: int,
    row_min: np.ndarray,
    row_arg: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """Row ``k``'s smallest count among the allowed classes it holds, and the first such class."""
    row_arg[k] = -1
    row_min[k] = math.inf
    for i in range(n_allowed):
        c = allowed[i]
        if counts[k, c] > 0 and x[k, c] < row_min[k]:
            row_min[k] = x[k, c]
            row_arg[k] = c
