"""Per-client and per-class evaluation of a global model (``run.per_client_eval``).

One pass over the (balanced) global test set gives the confusion matrix; from it come the
per-class accuracy and F1, macro F1 and the minority-class F1 (``felix.metrics.classification``,
the DAFL paper's measures). A client's accuracy is the per-class test accuracy reweighted to the
client's training label mix, ``sum_c pi_ic acc_c`` (FedeRage's experiment: the paper does not
say how per-client test sets are formed, and this holds no client data out of training). Over
clients: the mean, the worst, the bottom 10%, the spread and the *rare clients*, those least
likely to take part (``rare_client_mask`` of their participation probability: the Random Access
Model's p under ``trace.kind: ram``, else the share of the run each client's trace has it
available). Tail classes: the rarest classes by global training count.

Measured on the final model of a run (the summary's ``per_client`` section), not on every
evaluation, from the run's test pass (``felix.metrics.test_pass``): when the final model was
evaluated, its logits are read again, not computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from felix.metrics.classification import class_metrics, minority_classes
from felix.metrics.test_pass import TestPass

__all__ = [
    "PerClientSetup",
    "make_per_client_eval",
    "per_client_metrics",
    "rare_client_mask",
]


@dataclass(frozen=True)
class PerClientSetup:
    """What the per-client measures need to know about the federation."""

    class_counts: NDArray[np.int64]  # clients x classes: training samples, before any augmentation
    participation: NDArray[np.float64]  # per client: probability (or share of time) of taking part
    tail_classes: NDArray[np.intp]  # the classes whose mean accuracy is the tail-class column
    rare_p: float | None = None  # rare clients: p <= rare_p (None: the lowest-p quarter by rank)

    def __post_init__(self) -> None:
        counts = np.asarray(self.class_counts)
        if counts.ndim != 2 or (counts.sum(axis=1) <= 0).any():
            raise ValueError(
                "per-client evaluation needs a clients x classes count matrix with data on every row"
            )
        if np.shape(self.participation) != (counts.shape[0],):
            raise ValueError(
                f"{np.size(self.participation)} participation values for {counts.shape[0]} clients"
            )


def per_client_metrics(cm: NDArray[np.int64], setup: PerClientSetup) -> dict[str, Any]:
    """Every per-client and per-class measure from the test confusion matrix ``cm``."""
    cm = np.asarray(cm)
    counts = np.asarray(setup.class_counts, dtype=np.float64)
    if cm.shape != (counts.shape[1], counts.shape[1]):
        raise ValueError(f"confusion matrix {cm.shape} for {counts.shape[1]} classes")
    per_class_n = cm.sum(axis=1)
    acc_c = np.divide(np.diag(cm), per_class_n, out=np.zeros(cm.shape[0]), where=per_class_n > 0)
    minority = minority_classes(counts.sum(axis=0))
    cls = class_metrics(cm, minority)
    acc = (counts / counts.sum(axis=1, keepdims=True)) @ acc_c
    rare = rare_client_mask(setup.participation, setup.rare_p)
    k = max(1, math.ceil(0.1 * len(acc)))
    return {
        "mean_client_acc": float(acc.mean()),
        "worst_client_acc": float(acc.min()),
        "bottom10_acc": float(np.sort(acc)[:k].mean()),
        "rare_client_acc": float(acc[rare].mean()),
        "std_client_acc": float(acc.std()),
        "global_acc": cls.accuracy,
        "tail_class_acc": float(acc_c[setup.tail_classes].mean()),
        "macro_f1": cls.macro_f1,
        "minority_f1": cls.minority_f1,
        "per_class_acc": [float(v) for v in acc_c],
        "per_class_f1": list(cls.per_class_f1),
        "client_acc": [float(v) for v in acc],
        "rare_clients": [int(i) for i in np.flatnonzero(rare)],
        "tail_classes": [int(c) for c in setup.tail_classes],
        "minority_classes": [int(c) for c in minority],
    }


def rare_client_mask(
    probabilities: np.ndarray, threshold: float | None = None, fraction: float = 0.25
) -> np.ndarray:
    """Which clients count as rare: ``p_i <= threshold`` when a threshold is given, else the
    ``ceil(fraction * N)`` clients with the lowest ``p`` by rank (ties broken by client index).

    A quantile test such as ``p <= quantile(p, 0.25)`` breaks on ties: with two participation
    levels and more than 75% frequent clients the quartile *is* the frequent level, so every
    client passes. The rank rule always selects exactly the lowest-p quarter; the explicit
    threshold (e.g. the rare level of a two-level RAM) selects every client at or below it.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probabilities must be a non-empty 1-D array, got shape {p.shape}")
    if threshold is not None:
        if not np.isfinite(threshold):
            raise ValueError(f"rare-client threshold must be finite, not {threshold}")
        mask = p <= threshold
        if not mask.any():
            raise ValueError(f"no client has p <= {threshold} (lowest p is {p.min():.4g})")
        return mask
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"rare-client fraction must lie in (0, 1], not {fraction}")
    mask = np.zeros(p.size, dtype=bool)
    mask[np.argsort(p, kind="stable")[: math.ceil(fraction * p.size)]] = True
    return mask


def make_per_client_eval(
    test_pass: TestPass, setup: PerClientSetup
) -> Callable[[np.ndarray], dict[str, Any]]:
    """``weights -> per_client_metrics`` from the run's test pass (``felix.metrics.test_pass``),
    plus whether the weights are finite (a diverged model predicts one class, so its accuracies
    alone can hide the blow-up)."""

    def evaluate(weights: np.ndarray) -> dict[str, Any]:
        out = per_client_metrics(test_pass.confusion(weights), setup)
        out["finite_model"] = bool(np.isfinite(weights).all())
        return out

    return evaluate
