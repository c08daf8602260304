"""Class-imbalance measures and the DAFL time model.

DAFL (the DAFL paper) plans augmentation from nothing but the
client x class count matrix ``N`` (K clients, C classes) that the clients share
with the server, so every quantity here is a pure function of ``N`` and of the
augmentation matrix ``A`` (same shape). Equation numbers refer to the paper.

Conventions, chosen so that the numbers are well defined for every input the
planner can meet:

* A client with no samples has no class distribution: its row of
  :func:`local_class_proportions` and its :func:`local_class_imbalance` are NaN.
  It weighs ``p_k = 0`` in ``I`` (eq. 14), so it adds nothing there.
* ``L^2 C G^2`` is one unknown constant in the paper (set to 1 in its
  experiments), so it is a single argument ``smoothness`` here, not built from
  the number of classes.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "MAX_COUNT",
    "as_count_matrix",
    "augmentation_time",
    "client_fractions",
    "global_class_imbalance",
    "global_class_proportions",
    "label_proportion_deviations",
    "label_proportion_imbalance",
    "local_class_imbalance",
    "local_class_proportions",
    "objective",
    "training_time",
]


#: Largest count accepted in one cell (client, class): 2^31 - 1, far above any real client and
#: low enough that sums, squares and float copies of the counts stay exact in int64 and float64.
MAX_COUNT = 2**31 - 1


def as_count_matrix(counts: ArrayLike, name: str = "N") -> NDArray[np.int64]:
    """Validate a client x class matrix of non-negative integers up to ``MAX_COUNT``.

    Floats holding whole numbers are accepted because counts often come back
    from numpy reductions or CSV readers as floats; anything fractional,
    negative, non-finite, above ``MAX_COUNT`` (the error names the cell) or not
    2-D is a caller bug and raises ``ValueError``. Python integers too large for
    int64 are checked before any conversion, so they never overflow.
    """
    try:
        arr = np.asarray(counts)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"{name} is not a matrix of counts ({exc})") from None
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D client x class matrix, got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    if arr.dtype.kind == "O" and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in arr.flat
    ):
        for (k, c), v in np.ndenumerate(arr):
            if not 0 <= v <= MAX_COUNT:
                raise ValueError(
                    f"{name}[{k}, {c}] = {v} is {'negative' if v < 0 else 'above the maximum count'}"
                    f"{'' if v < 0 else f' {MAX_COUNT}'}"
                )
        arr = arr.astype(np.int64)
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "f" and not (np.all(np.isfinite(arr)) and np.all(arr == np.round(arr))):
        raise ValueError(f"{name} must hold whole numbers")
    big = arr > MAX_COUNT
    if np.any(big):
        k, c = np.argwhere(big)[0]
        raise ValueError(f"{name}[{k}, {c}] = {int(arr[k, c])} is above the maximum count {MAX_COUNT}")
    out = arr.astype(np.int64)
    if np.any(out < 0):
        k, c = np.argwhere(out < 0)[0]
        raise ValueError(f"{name}[{k}, {c}] = {out[k, c]} is negative")
    return out


def client_fractions(counts: ArrayLike) -> NDArray[np.float64]:
    """``p_k = n_k / n`` (eq. 1): each client's weight in FedAvg and in ``I``."""
    n_mat = as_count_matrix(counts)
    total = n_mat.sum()
    if total == 0:
        raise ValueError("N holds no samples")
    return n_mat.sum(axis=1) / total


def local_class_proportions(counts: ArrayLike) -> NDArray[np.float64]:
    """``pi_k(c) = n_k^(c) / n_k`` (eq. 2), NaN rows for clients without samples."""
    n_mat = as_count_matrix(counts)
    sizes = n_mat.sum(axis=1, keepdims=True).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sizes > 0, n_mat / sizes, np.nan)


def global_class_proportions(counts: ArrayLike) -> NDArray[np.float64]:
    """``pi(c) = n^(c) / n`` (eq. 3).

    Computed from the column totals rather than as ``sum_k p_k pi_k(c)`` so that
    two matrices with the same column totals give bit-identical results: the
    planner relies on that when it compares candidate moves.
    """
    n_mat = as_count_matrix(counts)
    total = n_mat.sum()
    if total == 0:
        raise ValueError("N holds no samples")
    return n_mat.sum(axis=0) / total


def label_proportion_deviations(counts: ArrayLike) -> NDArray[np.float64]:
    """``delta_k^2 = ||pi_k - pi||_2^2`` (eq. 11), NaN for clients without samples."""
    local = local_class_proportions(counts)
    return np.sum((local - global_class_proportions(counts)) ** 2, axis=1)


def label_proportion_imbalance(counts: ArrayLike) -> float:
    """``I = sum_k p_k delta_k^2`` (eq. 14), the term of the convergence bound
    that augmentation can shrink."""
    weights = client_fractions(counts)
    deviations = label_proportion_deviations(counts)
    present = weights > 0
    return float(np.sum(weights[present] * deviations[present]))


def local_class_imbalance(counts: ArrayLike) -> NDArray[np.float64]:
    """``J_k = sum_c (pi_k(c) - 1/C)^2`` (Sec. III-B), NaN for empty clients.

    This is what the Local Balancing baseline drives below ``tau``.
    """
    local = local_class_proportions(counts)
    return np.sum((local - 1.0 / local.shape[1]) ** 2, axis=1)


def global_class_imbalance(counts: ArrayLike) -> float:
    """``J = sum_c (pi(c) - 1/C)^2`` (Sec. III-B), the constraint of Problem 1.

    Lies in ``[0, (C-1)/C]``; 0 means the union of all client data is uniform.
    The sum runs in class order (sequentially, not numpy's pairwise order): the
    DAFL planner's ``float`` rule decides ``J <= tau`` on exactly this value.
    """
    glob = global_class_proportions(counts)
    deviations = glob - 1.0 / glob.shape[0]
    return float(np.add.accumulate(deviations * deviations)[-1])


def augmentation_time(augmentation: ArrayLike, *, zeta: float) -> float:
    """``T_a = zeta * max_k sum_c a_k^(c)`` (eq. 16).

    Clients augment in parallel, so only the busiest one is on the critical path.
    """
    a_mat = as_count_matrix(augmentation, "A")
    return float(zeta * a_mat.sum(axis=1).max())


def training_time(
    counts: ArrayLike,
    augmentation: ArrayLike,
    *,
    zeta_prime: float,
    epsilon: float,
    local_updates: int,
    smoothness: float,
) -> float:
    """``T_t = (1 + (E-1)^2 L^2CG^2 I) / epsilon * zeta' * max_k (n_k + a_k)`` (eq. 17).

    ``(1 + (E-1)^2 L^2CG^2 I) / epsilon`` is the paper's proxy for the number of
    rounds, with ``I`` measured on the augmented data ``N + A``; the largest
    augmented client sets the duration of each synchronous round.
    ``local_updates`` is ``E`` and ``smoothness`` is ``L^2 C G^2``.
    """
    n_mat = as_count_matrix(counts)
    a_mat = as_count_matrix(augmentation, "A")
    if a_mat.shape != n_mat.shape:
        raise ValueError(f"A has shape {a_mat.shape}, N has shape {n_mat.shape}")
    augmented = n_mat + a_mat
    drift = (local_updates - 1) ** 2 * smoothness * label_proportion_imbalance(augmented)
    rounds = (1.0 + drift) / epsilon
    return float(rounds * zeta_prime * augmented.sum(axis=1).max())


def objective(
    counts: ArrayLike,
    augmentation: ArrayLike,
    *,
    lambda1: float,
    lambda2: float,
    zeta: float,
    zeta_prime: float,
    epsilon: float,
    local_updates: int,
    smoothness: float,
) -> float:
    """``P = lambda1 * T_t + lambda2 * T_a``, the objective of Problem 1."""
    t_train = training_time(
        counts,
        augmentation,
        zeta_prime=zeta_prime,
        epsilon=epsilon,
        local_updates=local_updates,
        smoothness=smoothness,
    )
    return float(lambda1 * t_train + lambda2 * augmentation_time(augmentation, zeta=zeta))
