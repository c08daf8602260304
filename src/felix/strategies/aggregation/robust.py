"""Robust aggregation: coordinate-wise (weighted) median or trimmed mean, over any strategy's weights.

A weighted mean lets one update move every coordinate as far as its value and weight allow; the
median and the trimmed mean (Yin et al., ICML 2018, "Byzantine-robust distributed learning") bound
what a minority of updates can do to each coordinate. ``RobustAggregator`` wraps the strategy's
own aggregator and keeps its weighting (FedAvg's sample counts, FedBuff's staleness, TierFuse's
staleness and utility...), replacing only the weighted *mean* of the deltas by:

- ``median``: per coordinate, the weighted median of the updates' values (the mean of the lower
  and upper weighted medians, so equal weights give the textbook median);
- ``trimmed_mean``: per coordinate, the weighted mean after removing ``trim`` of the weight mass
  from each end of the sorted values (a boundary update counts with the part of its weight that
  falls inside). ``trim = 0`` is the plain weighted mean.

The server step is the inner aggregator's server optimiser applied to the robust step (plain
``theta + server_lr * robust_step`` by default), with its ``server_lr`` and per-update ``clip_norm``; its ``normalize`` setting does not apply (a median has no
denominator). Aux entries are reduced as by every aggregator (``reduce_aux``), since validation
already pins their shapes. Selected with ``aggregator.robust: median | trimmed_mean`` in the config.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from felix.core.aggregation import Aggregator, reduce_aux
from felix.core.types import BufferedUpdate
from felix.core.validation import AuxDecl, l2_norm

ROBUST_METHODS = ("median", "trimmed_mean")
_EPS = 1e-12


# Both statistics are computed by pairwise comparison of the k updates (k^2 vector operations over
# the P coordinates) rather than by sorting each coordinate: for the k ~ 10 updates of a buffer
# that is an order of magnitude faster than numpy's per-row argsort (1.3 s at P = 537,610).


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of ``values`` (k x P), the weighted median under ``weights`` (k, summing to 1):
    the mean of the smallest value with at least half the weight at or below it (lower median)
    and the smallest with more than half (upper median)."""
    lower = np.full(values.shape[1], np.inf)
    upper = np.full(values.shape[1], np.inf)
    for vj in values:
        upto = np.zeros(values.shape[1])
        for vi, wi in zip(values, weights):
            upto += (vi <= vj) * wi
        lower = np.minimum(lower, np.where(upto >= 0.5 - _EPS, vj, np.inf))
        upper = np.minimum(upper, np.where(upto > 0.5 + _EPS, vj, np.inf))
    return 0.5 * (lower + upper)


def weighted_trimmed_mean(values: np.ndarray, weights: np.ndarray, trim: float) -> np.ndarray:
    """Per column, the weighted mean of the middle ``1 - 2 trim`` of the weight mass: in sorted order
    (ties by position), update j covers the weight interval ``(cum_j - w_j, cum_j]``, of which the
    part inside ``[trim, 1 - trim]`` counts."""
    num = np.zeros(values.shape[1])
    den = np.zeros(values.shape[1])
    for j, (vj, wj) in enumerate(zip(values, weights)):
        cum = np.zeros(values.shape[1])
        for i, (vi, wi) in enumerate(zip(values, weights)):
            cum += ((vi < vj) | ((vi == vj) & (i <= j))) * wi
        kept = np.clip(np.minimum(cum, 1.0 - trim) - np.maximum(cum - wj, trim), 0.0, None)
        num += kept * vj
        den += kept
    return num / den


class RobustAggregator(Aggregator):
    """The inner aggregator's weights, a robust per-coordinate statistic instead of the mean."""

    def __init__(self, inner: Aggregator, method: str = "median", trim: float = 0.2) -> None:
        if method not in ROBUST_METHODS:
            raise ValueError(f"robust aggregation must be one of {ROBUST_METHODS}, not {method!r}")
        if not 0.0 <= trim < 0.5:
            raise ValueError(f"trim must lie in [0, 0.5), not {trim}")
        super().__init__(inner.server_lr, "weights", inner.clip_norm, inner.optimizer)
        self.inner = inner
        self.method = method
        self.trim = float(trim)
        self.name = f"{inner.name}+{method}"

    def declared_aux(self, num_params: int) -> dict[str, AuxDecl]:
        return self.inner.declared_aux(num_params)

    def weights(self, buffer: Sequence[BufferedUpdate]) -> np.ndarray:
        return self.inner.weights(buffer)

    def aggregate(
        self, theta: np.ndarray, buffer: Sequence[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        if not buffer:
            raise ValueError(f"{self.name}: nothing to aggregate")
        w = np.asarray(self.weights(buffer), dtype=np.float64)
        total = float(w.sum())
        if not (total > 0 and np.isfinite(total)) or (w < 0).any():
            if total == 0 and not (w < 0).any():
                return theta.copy(), np.zeros(len(buffer)), {}  # e.g. TierFuse's t_max dropped them all
            raise ValueError(f"{self.name}: aggregation weights {w.tolist()[:5]} are not usable")
        norm_w = w / total
        deltas = np.empty((len(buffer), theta.size), dtype=np.float32)
        for i, item in enumerate(buffer):
            d = item.update.delta
            assert d is not None
            if self.clip_norm is not None:
                n = l2_norm(d)
                if n > self.clip_norm:
                    d = d * np.float32(self.clip_norm / n)
            deltas[i] = d
        if self.method == "median":
            step = weighted_median(deltas, norm_w)
        else:
            step = weighted_trimmed_mean(deltas, norm_w, self.trim)
        new_theta = self.optimizer.step(theta, step.astype(np.float32), self.server_lr).astype(np.float32)
        return new_theta, norm_w, reduce_aux(buffer, norm_w)
