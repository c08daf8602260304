"""I, J, J_k and the DAFL time model pinned to hand-computed values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from felix.strategies.dataplans import imbalance as im
from felix.strategies.dataplans.dafl import DaflParams
from felix.strategies.dataplans.dafl_tables import (
    DATASET_NAMES,
    TABLE_II_GLOBAL,
    TABLE_II_IMBALANCE,
    partition,
)

# Paper defaults: alpha = lambda1 * zeta' / epsilon = 1 * 2 / 0.001 = 2000, beta = lambda2 * zeta = 100.
TIME = {"zeta_prime": 2.0, "epsilon": 1e-3, "local_updates": 2, "smoothness": 1.0}


def test_symmetric_two_by_two() -> None:
    # N = [[3, 1], [1, 3]]: n = 8, p = (1/2, 1/2), pi_1 = (3/4, 1/4), pi_2 = (1/4, 3/4), pi = (1/2, 1/2).
    # delta_k^2 = (1/4)^2 + (1/4)^2 = 1/8 for both, I = 1/2 * 1/8 + 1/2 * 1/8 = 1/8.
    # J = 0 (globally balanced), J_k = (3/4 - 1/2)^2 + (1/4 - 1/2)^2 = 1/8.
    n = [[3, 1], [1, 3]]
    assert im.label_proportion_imbalance(n) == pytest.approx(1 / 8)
    assert im.global_class_imbalance(n) == pytest.approx(0.0)
    np.testing.assert_allclose(im.local_class_imbalance(n), [1 / 8, 1 / 8])
    np.testing.assert_allclose(im.label_proportion_deviations(n), [1 / 8, 1 / 8])


def test_unequal_clients() -> None:
    # N = [[6, 2], [1, 1]]: n = 10, p = (0.8, 0.2), pi_1 = (0.75, 0.25), pi_2 = (0.5, 0.5), pi = (0.7, 0.3).
    # delta_1^2 = 0.05^2 + 0.05^2 = 0.005, delta_2^2 = 0.2^2 + 0.2^2 = 0.08.
    # I = 0.8 * 0.005 + 0.2 * 0.08 = 0.004 + 0.016 = 0.02.
    # J = 0.2^2 + 0.2^2 = 0.08; J_1 = 2 * 0.25^2 = 0.125, J_2 = 0.
    n = [[6, 2], [1, 1]]
    np.testing.assert_allclose(im.client_fractions(n), [0.8, 0.2])
    np.testing.assert_allclose(im.local_class_proportions(n), [[0.75, 0.25], [0.5, 0.5]])
    np.testing.assert_allclose(im.global_class_proportions(n), [0.7, 0.3])
    np.testing.assert_allclose(im.label_proportion_deviations(n), [0.005, 0.08])
    assert im.label_proportion_imbalance(n) == pytest.approx(0.02)
    assert im.global_class_imbalance(n) == pytest.approx(0.08)
    np.testing.assert_allclose(im.local_class_imbalance(n), [0.125, 0.0], atol=1e-15)


def test_three_classes_single_client() -> None:
    # One client always matches the global distribution: I = 0.
    # pi = (1/6, 2/6, 3/6): J = (1/6 - 1/3)^2 + 0 + (1/2 - 1/3)^2 = 1/36 + 1/36 = 1/18.
    n = [[1, 2, 3]]
    assert im.label_proportion_imbalance(n) == pytest.approx(0.0, abs=1e-15)
    assert im.global_class_imbalance(n) == pytest.approx(1 / 18)
    np.testing.assert_allclose(im.local_class_imbalance(n), [1 / 18])


def test_time_model_by_hand() -> None:
    # N = [[6, 2], [1, 1]], A = [[0, 2], [3, 0]]: a = (2, 3), so T_a = zeta * 3.
    # N + A = [[6, 4], [4, 1]]: n = 15, sizes (10, 5), p = (2/3, 1/3), pi = (2/3, 1/3),
    # pi_1 = (0.6, 0.4): delta_1^2 = 2 * (1/15)^2 = 2/225; pi_2 = (0.8, 0.2): delta_2^2 = 2 * (2/15)^2 = 8/225.
    # I = 2/3 * 2/225 + 1/3 * 8/225 = 12/675 = 4/225.
    # T_t = (1 + (2-1)^2 * 1 * 4/225) / 0.001 * 2 * 10 = 20000 * 229/225 = 20355.55...
    # P = 1 * T_t + 100 * 3 = 20655.55...
    n, a = [[6, 2], [1, 1]], [[0, 2], [3, 0]]
    assert im.label_proportion_imbalance(np.add(n, a)) == pytest.approx(4 / 225)
    assert im.augmentation_time(a, zeta=1.0) == 3.0
    assert im.augmentation_time(a, zeta=0.5) == 1.5
    assert im.training_time(n, a, **TIME) == pytest.approx(20000 * 229 / 225)
    assert im.objective(n, a, lambda1=1.0, lambda2=100.0, zeta=1.0, **TIME) == pytest.approx(
        20000 * 229 / 225 + 300
    )
    # E = 3 and L^2 C G^2 = 0.5: the I factor is (3-1)^2 * 0.5 = 2, so T_t = 20000 * (1 + 8/225).
    assert im.training_time(
        n, a, zeta_prime=2.0, epsilon=1e-3, local_updates=3, smoothness=0.5
    ) == pytest.approx(20000 * 233 / 225)
    assert DaflParams().objective(n, a) == pytest.approx(20000 * 229 / 225 + 300)
    assert DaflParams(local_updates=3, smoothness=0.5).drift_weight == 2.0


def test_no_augmentation_costs_only_training() -> None:
    # A = 0: T_a = 0 and T_t = (1 + I) / eps * zeta' * max n_k with I = 1/8 for [[3, 1], [1, 3]].
    n = [[3, 1], [1, 3]]
    zero = np.zeros((2, 2), dtype=int)
    assert im.augmentation_time(zero, zeta=1.0) == 0.0
    assert im.training_time(n, zero, **TIME) == pytest.approx((1 + 1 / 8) / 1e-3 * 2 * 4)


def test_empty_client_has_no_weight() -> None:
    n = [[2, 2], [0, 0]]
    assert im.label_proportion_imbalance(n) == 0.0
    assert np.isnan(im.local_class_proportions(n)[1]).all()
    assert np.isnan(im.local_class_imbalance(n)[1])
    assert im.local_class_imbalance(n)[0] == 0.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([[1, -1]], "negative"),
        ([[1.5, 2]], "whole numbers"),
        ([1, 2], "2-D"),
        (np.zeros((0, 3)), "empty"),
        ([["a", "b"]], "integers"),
        ([[True, False]], "integers"),
    ],
)
def test_rejects_bad_matrices(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        im.as_count_matrix(bad)


def test_shape_mismatch_between_n_and_a() -> None:
    with pytest.raises(ValueError, match="shape"):
        im.training_time([[1, 2]], [[1, 2, 3]], **TIME)


def test_float_definitions_match_exact_fractions() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = rng.integers(0, 30, size=(rng.integers(1, 5), rng.integers(2, 6)))
        n[0, 0] += 1  # at least one sample
        total = int(n.sum())
        col = n.sum(axis=0)
        pi = [Fraction(int(v), total) for v in col]
        exact_i = sum(
            (
                Fraction(int(row.sum()), total)
                * sum((Fraction(int(v), int(row.sum())) - pi[c]) ** 2 for c, v in enumerate(row))
                for row in n
                if row.sum() > 0
            ),
            Fraction(0),
        )
        exact_j = sum((p - Fraction(1, n.shape[1])) ** 2 for p in pi)
        assert im.label_proportion_imbalance(n) == pytest.approx(float(exact_i), abs=1e-14)
        assert im.global_class_imbalance(n) == pytest.approx(float(exact_j), abs=1e-14)


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_table_ii_partitions(name: str) -> None:
    counts = partition(name)
    assert counts.shape == (8, 8)
    printed_i, printed_j = TABLE_II_IMBALANCE[name]
    if name == "D4":
        # The printed rows do not add up to the printed Global row (see dafl_tables); J of the
        # Global row itself is the printed one.
        assert tuple(counts.sum(axis=0)) != TABLE_II_GLOBAL[name]
        assert round(im.global_class_imbalance([TABLE_II_GLOBAL[name]]), 4) == printed_j
        return
    assert tuple(counts.sum(axis=0)) == TABLE_II_GLOBAL[name]
    assert round(im.label_proportion_imbalance(counts), 4) == printed_i
    assert round(im.global_class_imbalance(counts), 4) == printed_j


def test_partition_is_a_fresh_copy() -> None:
    first = partition("d1")
    first[0, 0] = 10**6
    assert partition("D1")[0, 0] == 52
    assert partition("D1")[2, 5] == 580
    with pytest.raises(ValueError, match="unknown partition"):
        partition("D7")
