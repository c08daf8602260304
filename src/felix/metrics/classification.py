"""Per-class test metrics for class-imbalance experiments: confusion matrix, per-class and macro
F1, and the DAFL paper's minority-class F1.

The DAFL paper evaluates on a balanced test set and reports "the F1-score of the minority class":
the class with the fewest training samples in the federation (class 4 of its D2, 20 of 6,816
samples). Here that is every class sharing the smallest global training count, averaged when
several tie, decided on the partition before any augmentation (augmentation is what the
methods differ in, the minority class is a property of the data).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["ClassMetrics", "class_metrics", "confusion_matrix", "f1_per_class", "minority_classes"]


def confusion_matrix(y_true: ArrayLike, y_pred: ArrayLike, num_classes: int) -> NDArray[np.int64]:
    """``cm[t, p]``: test samples of class ``t`` predicted as ``p``."""
    t = np.asarray(y_true, dtype=np.int64)
    p = np.asarray(y_pred, dtype=np.int64)
    if t.shape != p.shape or t.ndim != 1:
        raise ValueError(f"y_true and y_pred must be vectors of one length, got {t.shape} and {p.shape}")
    if t.size and (min(t.min(), p.min()) < 0 or max(t.max(), p.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    return np.bincount(t * num_classes + p, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes
    )


def f1_per_class(cm: ArrayLike) -> NDArray[np.float64]:
    """``F1_c = 2 TP / (2 TP + FP + FN)``; 0 for a class never present nor predicted (the usual
    ``zero_division=0`` convention, which cannot arise on a test set holding every class)."""
    m = np.asarray(cm, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"a confusion matrix is square, got shape {m.shape}")
    tp = np.diag(m)
    denom = m.sum(axis=0) + m.sum(axis=1)  # (TP + FP) + (TP + FN)
    return np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)


def minority_classes(train_class_counts: ArrayLike) -> NDArray[np.intp]:
    """The classes with the smallest global training count (all of them when several tie)."""
    counts = np.asarray(train_class_counts)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"need a non-empty vector of class counts, got shape {counts.shape}")
    return np.flatnonzero(counts == counts.min())


@dataclass(frozen=True)
class ClassMetrics:
    accuracy: float
    macro_f1: float
    minority_f1: float
    per_class_f1: tuple[float, ...]


def class_metrics(cm: ArrayLike, minority: ArrayLike) -> ClassMetrics:
    """Accuracy, macro F1 and the (mean) F1 of the ``minority`` classes from a confusion matrix."""
    m = np.asarray(cm)
    total = m.sum()
    if total == 0:
        raise ValueError("the confusion matrix holds no test samples")
    f1 = f1_per_class(m)
    idx = np.asarray(minority, dtype=np.intp)
    if idx.size == 0:
        raise ValueError("no minority class given")
    return ClassMetrics(
        float(np.trace(m) / total), float(f1.mean()), float(f1[idx].mean()), tuple(float(v) for v in f1)
    )
