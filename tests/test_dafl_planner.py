"""The DAFL planner (Algorithm 1) and the LB baseline.

Defaults throughout: lambda1 = 1, lambda2 = 100, tau = 0.001, epsilon = 0.001,
zeta = 1, zeta' = 2, E = 2, L^2 C G^2 = 1, so
P = 2000 * max_k(n_k + a_k) * (1 + I(N + A)) + 100 * max_k a_k.
Table III, the rules, speed and bounds are in test_dafl_table3.py.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from felix.strategies.dataplans.dafl import (
    P_RTOL,
    DaflParams,
    plan_dafl,
    plan_local_balancing,
)
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition
from felix.strategies.dataplans.imbalance import (
    global_class_imbalance,
    label_proportion_imbalance,
    local_class_imbalance,
)

# ---------------------------------------------------------------------------
# Straightforward reference: Algorithm 1 read literally, every candidate's J and
# P evaluated from the definitions in exact rational arithmetic, so that there
# is no float noise at all. Same rules as the planner's "exact" rule: only cells
# with N[k, c] > 0 are candidates; exact J ties; P within a relative P_RTOL of the
# smallest counts as a tie; ties go to the first pair in row-major order.
# ---------------------------------------------------------------------------

RTOL = Fraction(P_RTOL)


def exact_j(m: list[list[int]]) -> Fraction:
    n, classes = sum(map(sum, m)), len(m[0])
    return sum((Fraction(sum(row[c] for row in m), n) - Fraction(1, classes)) ** 2 for c in range(classes))


def exact_i(m: list[list[int]]) -> Fraction:
    n, classes = sum(map(sum, m)), len(m[0])
    pi = [Fraction(sum(row[c] for row in m), n) for c in range(classes)]
    total = Fraction(0)
    for row in m:
        size = sum(row)
        if size:
            total += Fraction(size, n) * sum((Fraction(row[c], size) - pi[c]) ** 2 for c in range(classes))
    return total


def exact_p(n: list[list[int]], a: list[list[int]], prm: DaflParams) -> Fraction:
    m = [[x + y for x, y in zip(rn, ra)] for rn, ra in zip(n, a)]
    rounds = (1 + (prm.local_updates - 1) ** 2 * Fraction(prm.smoothness) * exact_i(m)) / Fraction(
        prm.epsilon
    )
    t_train = rounds * Fraction(prm.zeta_prime) * max(map(sum, m))
    t_aug = Fraction(prm.zeta) * max(map(sum, a))
    return Fraction(prm.lambda1) * t_train + Fraction(prm.lambda2) * t_aug


def reference_dafl(counts: np.ndarray, prm: DaflParams) -> np.ndarray:
    n = counts.tolist()
    k_count, c_count, s, tau = len(n), len(n[0]), prm.step, Fraction(prm.tau)
    a = [[0] * c_count for _ in range(k_count)]
    cells = [(k, c) for k in range(k_count) for c in range(c_count) if n[k][c] > 0]

    def plus(k: int, c: int) -> list[list[int]]:
        b = [row[:] for row in a]
        b[k][c] += s
        return b

    def augmented(b: list[list[int]]) -> list[list[int]]:
        return [[x + y for x, y in zip(rn, rb)] for rn, rb in zip(n, b)]

    while exact_j(augmented(a)) > tau:  # Phase 1
        js = {cell: exact_j(augmented(plus(*cell))) for cell in cells}
        tied = [cell for cell in cells if js[cell] == min(js.values())]
        ps = {cell: exact_p(n, plus(*cell), prm) for cell in tied}
        k, c = next(cell for cell in tied if ps[cell] <= min(ps.values()) * (1 + RTOL))
        a[k][c] += s
    current = exact_p(n, a, prm)
    while True:  # Phase 2
        feasible = [cell for cell in cells if exact_j(augmented(plus(*cell))) <= tau]
        if not feasible:
            break
        ps = {cell: exact_p(n, plus(*cell), prm) for cell in feasible}
        best = min(ps.values())
        if not best < current * (1 - RTOL):
            break
        k, c = next(cell for cell in feasible if ps[cell] <= best * (1 + RTOL))
        a[k][c] += s
        current = ps[(k, c)]
    return np.array(a, dtype=np.int64)


def reference_lb(counts: np.ndarray, tau: float, step: int) -> np.ndarray:
    a = np.zeros_like(counts)
    for k, row in enumerate(counts.tolist()):
        if sum(row) == 0:
            continue
        while exact_j([row]) > Fraction(tau):
            c = row.index(min(row))
            row[c] += step
            a[k, c] += step
    return a


# ---------------------------------------------------------------------------
# Hand-traced cases
# ---------------------------------------------------------------------------


def test_two_by_two_prefers_smaller_round_time() -> None:
    # N = [[2, 1], [1, 1]]: totals (3, 2), J = 0.1^2 + 0.1^2 = 0.02 > tau.
    # Phase 1: class 2 is the rarest, candidates (0, 1) and (1, 1); both give totals (3, 3), J = 0.
    #   (0, 1): [[2, 2], [1, 1]], I = 0, max size 4, max a 1 -> P = 2000 * 4 + 100 = 8100.
    #   (1, 1): [[2, 1], [1, 2]], delta^2 = 2 * (1/6)^2 = 1/18 for both clients, I = 1/18,
    #           max size 3 -> P = 2000 * 3 * 19/18 + 100 = 6433.3   <- smaller, chosen.
    # J = 0 ends Phase 1. Phase 2: any +1 gives totals (4, 3), J = 2 * (1/14)^2 = 0.0102 > tau: nothing.
    plan = plan_dafl([[2, 1], [1, 1]])
    assert plan.A.tolist() == [[0, 0], [0, 1]]
    assert plan.I_after == pytest.approx(1 / 18)
    assert plan.J_after == 0.0
    # With L^2 C G^2 = 10 the imbalance weighs more: (1, 1) costs 2000 * 3 * (1 + 10/18) + 100 = 9433.3,
    # (0, 1) still 8100, so (0, 1) wins.
    assert plan_dafl([[2, 1], [1, 1]], DaflParams(smoothness=10.0)).A.tolist() == [[0, 1], [0, 0]]


def test_two_by_three_phase_one_trace() -> None:
    # N = [[3, 3, 1], [3, 3, 2]]: totals (6, 6, 3), n = 15, J = 2 * (1/15)^2 + (2/15)^2 = 6/225 > tau.
    # Step 1, class 3 (total 3):
    #   (0, 2): rows become identical [3, 3, 2] -> I = 0, max size 8, max a 1: P = 16000 + 100 = 16100.
    #   (1, 2): [[3, 3, 1], [3, 3, 3]], pi = (3/8, 3/8, 1/4); delta_1^2 = 2 (3/56)^2 + (3/28)^2 = 54/3136,
    #           delta_2^2 = 2 (1/24)^2 + (1/12)^2 = 1/96, I = 7/16 * 54/3136 + 9/16 * 1/96 = 0.013393,
    #           max size 9: P = 18000 * 1.013393 + 100 = 18341.1.  -> (0, 2).
    # Step 2, class 3 (total 4); J = 6/576 = 0.0104 > tau:
    #   (0, 2): [[3, 3, 3], [3, 3, 2]], max a 2; (1, 2): [[3, 3, 2], [3, 3, 3]], max a 1. Mirror images,
    #           so same I (0.0025952) and max size 9: P = 18046.7 + 200 vs 18046.7 + 100.  -> (1, 2).
    # Step 3, class 3 (total 5); J = 6/2601 = 0.0023 > tau:
    #   (0, 2): all counts 3 -> I = 0, max size 9, max a 2: P = 18200.
    #   (1, 2): [[3, 3, 2], [3, 3, 4]], max size 10: P > 20000.  -> (0, 2). J = 0, Phase 1 over.
    # Phase 2: any +1 gives totals like (7, 6, 6), J = 6/3249 = 0.0018 > tau: infeasible.
    plan = plan_dafl([[3, 3, 1], [3, 3, 2]])
    assert plan.A.tolist() == [[0, 0, 2], [0, 0, 1]]
    assert plan.added == 3
    assert plan.added_per_client == (2, 1)
    assert plan.I_after == pytest.approx(0.0, abs=1e-15)


def test_two_by_two_phase_two_trace() -> None:
    # N = [[22, 24], [2, 1]]: totals (24, 25), n = 49, J = 2 * (1/98)^2 = 0.0002 <= tau: no Phase 1.
    # I = 46/49 * 2 (13/1127)^2 + 3/49 * 2 (26/147)^2 = 0.0040804, P = 2000 * 46 * 1.0040804 = 92375.4.
    # Any +1 on client 1 makes its size 47 > 46: P >= 94000, no good.
    #   (1, 0): [[22, 24], [3, 1]], totals (25, 25), I = 46/50 * 2/2116 + 4/50 * 1/8 = 1/92:
    #           P = 92000 * (1 + 1/92) + 100 = 93100 > 92375.4.
    #   (1, 1): [[22, 24], [2, 2]], totals (24, 26), J = 0.0008 feasible, I = 0.0000696:
    #           P = 92000 * 1.0000696 + 100 = 92106.4 < 92375.4.  -> (1, 1).
    # Next: (1, 0) -> [3, 2], totals (25, 26), I = 0.0026211, max a 2: P = 92241.1 + 200 > 92106.4;
    #       (1, 1) -> totals (24, 27), J = 0.0017 > tau: infeasible. Stop.
    plan = plan_dafl([[22, 24], [2, 1]])
    assert plan.A.tolist() == [[0, 0], [0, 1]]
    assert plan.I_before == pytest.approx(0.0040804, abs=1e-7)
    assert plan.I_after == pytest.approx(0.0000696, abs=1e-7)


def test_exact_ties_go_to_the_first_pair_in_row_major_order() -> None:
    # E = 1 removes I from P, so P = 2000 * max size + 100 * max a and ties are exact.
    # [[1, 2], [1, 2]], tau = 0.02: J = 2 (1/6)^2 = 0.056. Class 1 is rarest; (0, 0) and (1, 0) both give
    # P = 2000 * 4 + 100: the first row wins. Totals (3, 4): J = 0.0102 <= 0.02. Phase 2 cannot lower P.
    plan = plan_dafl([[1, 2], [1, 2]], DaflParams(tau=0.02, local_updates=1))
    assert plan.A.tolist() == [[1, 0], [0, 0]]
    # One client, classes 1 and 2 tie on J (equal totals) and on P: the lower class index wins.
    # (1, 1, 3): J = 24/225 = 0.107; after +1 on class 1: (2, 1, 3), J = 1/18 = 0.056 <= 0.06.
    assert plan_dafl([[1, 1, 3]], DaflParams(tau=0.06)).A.tolist() == [[1, 0, 0]]


def test_paper_partitions_regression() -> None:
    # Small Table II cases (fast to plan). D3 starts at J = 0.0010003 > tau: Phase 1 adds 7 samples to the
    # rarest class 2 (3671), each on the client with the smallest P; with lambda2 = 1e4 Phase 2 adds nothing.
    plan = plan_dafl(partition("D3"), DaflParams(lambda2=1e4))
    assert plan.added == 7
    assert plan.A[:, 1].sum() == 7
    assert plan.J_after <= 1e-3 < plan.J_before
    # Checked against a straightforward float implementation of Algorithm 1.
    assert plan_dafl(partition("D3"), DaflParams(lambda2=1e3)).added == 3080


# ---------------------------------------------------------------------------
# Against the reference
# ---------------------------------------------------------------------------


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, DaflParams]:
    while True:
        counts = rng.integers(0, rng.choice([6, 12, 30]), size=(rng.integers(1, 5), rng.integers(2, 5)))
        counts *= rng.random(counts.shape) < 0.85  # some clients miss some classes
        if counts.sum(axis=0).all():
            break
    params = DaflParams(
        lambda1=float(rng.choice([1.0, 0.5, 0.0])),
        lambda2=float(rng.choice([0.0, 1.0, 100.0, 1e4])),
        tau=float(rng.choice([1e-3, 1e-2, 0.05])),
        step=int(rng.choice([1, 1, 2, 3])),
        zeta_prime=float(rng.choice([2.0, 0.1])),
        local_updates=int(rng.choice([2, 2, 1, 3])),
        smoothness=float(rng.choice([1.0, 1.0, 25.0])),
    )
    return counts, params


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_on_random_small_matrices(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    for _ in range(40):
        counts, params = _random_case(rng)
        params = params.model_copy(update={"rule": "exact"})
        plan = plan_dafl(counts, params)
        expected = reference_dafl(counts, params)
        assert plan.A.tolist() == expected.tolist(), (counts.tolist(), params)
        assert plan.J_after <= params.tau
        assert not np.any(plan.A[counts == 0])


PLANS = json.loads((Path(__file__).parent / "data" / "dafl_table2_plans.json").read_text())


@pytest.mark.parametrize("lambda2", [1e2, 1e3, 1e4])
def test_paper_partitions_plans_are_unchanged(lambda2: float) -> None:
    # The plans for Table II's D1-D6 recorded before the planner was compiled: the "exact" rule
    # reproduces every one of them.
    for name in DATASET_NAMES:
        plan = plan_dafl(partition(name), DaflParams(lambda2=lambda2, rule="exact"))
        assert plan.A.tolist() == PLANS[f"{name}/{lambda2:g}"]


@pytest.mark.parametrize("seed", range(3))
def test_lb_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(2000 + seed)
    for _ in range(40):
        counts = rng.integers(1, 40, size=(rng.integers(1, 5), rng.integers(2, 6)))
        tau = float(rng.choice([1e-3, 1e-2, 0.0]))
        step = 1 if tau == 0 else int(rng.choice([1, 2, 5]))
        plan = plan_local_balancing(counts, tau, step=step, rule="exact")
        assert plan.A.tolist() == reference_lb(counts, tau, step).tolist()
        assert np.all(local_class_imbalance(counts + plan.A) <= tau + 1e-15)


# ---------------------------------------------------------------------------
# LB by hand
# ---------------------------------------------------------------------------


def test_lb_by_hand() -> None:
    # Client [2, 1]: J_1 = 2 (1/6)^2 = 1/18 > tau -> +1 on class 2 -> [2, 2], J_1 = 0. Client [1, 1]: balanced.
    assert plan_local_balancing([[2, 1], [1, 1]]).A.tolist() == [[0, 1], [0, 0]]
    # tau = 0 balances every client exactly: each class up to the client's largest count.
    plan = plan_local_balancing([[5, 1, 2], [1, 7, 3]], tau=0.0)
    assert plan.A.tolist() == [[0, 4, 3], [6, 0, 4]]
    assert plan.I_after == 0.0 and plan.J_after == 0.0
    assert plan.method == "lb" and plan.added == 17
    # Step 2 on [1, 4]: (3,4) .0102, (5,4) .0062, (5,6) .0041, (7,6) .0030, (7,8) .0022, (9,8) .0017,
    # (9,10) .0014, (11,10) .0011, (11,12) 2 (1/46)^2 = .00095 <= tau: 5 steps on class 1, 4 on class 2.
    assert plan_local_balancing([[1, 4]], step=2).A.tolist() == [[10, 8]]


def test_lb_rejects_missing_class_and_skips_empty_clients() -> None:
    with pytest.raises(ValueError, match="client 1 has no samples of class 0"):
        plan_local_balancing([[2, 3], [0, 3]])
    plan = plan_local_balancing([[2, 3], [0, 0]])
    assert plan.A[1].tolist() == [0, 0]


# ---------------------------------------------------------------------------
# Contract
# ---------------------------------------------------------------------------


def test_plan_fields_are_consistent() -> None:
    counts = np.array([[9, 2, 4], [1, 5, 1], [3, 3, 0]])
    plan = plan_dafl(counts)
    assert plan.method == "dafl"
    assert plan.A.dtype == np.int64 and plan.A.shape == counts.shape
    assert not plan.A.flags.writeable
    assert plan.added == int(plan.A.sum())
    assert plan.added_per_client == tuple(int(v) for v in plan.A.sum(axis=1))
    assert plan.I_before == label_proportion_imbalance(counts)
    assert plan.J_before == global_class_imbalance(counts)
    assert plan.I_after == label_proportion_imbalance(counts + plan.A)
    assert plan.J_after == global_class_imbalance(counts + plan.A) <= 1e-3
    assert 0 < plan.plan_seconds < 5
    assert plan.A[2, 2] == 0  # client 3 has no class-3 sample to augment from
    report = plan.to_dict()
    assert report["A"] == plan.A.tolist() and report["added_per_client"] == list(plan.added_per_client)


def test_empty_clients_change_nothing() -> None:
    counts = np.array([[9, 2, 4], [1, 5, 1]])
    with_empty = np.array([[9, 2, 4], [0, 0, 0], [1, 5, 1]])
    plan = plan_dafl(with_empty)
    assert plan.A[1].tolist() == [0, 0, 0]
    assert plan.A[[0, 2]].tolist() == plan_dafl(counts).A.tolist()


def test_already_balanced_needs_nothing() -> None:
    plan = plan_dafl([[5, 5], [5, 5]])
    assert plan.added == 0 and plan.A.tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": 0}, "step"),
        ({"tau": -0.1}, "tau"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"lambda2": float("nan")}, "lambda2"),
        ({"tau": 0.0, "step": 2}, "tau = 0"),
        ({"local_updates": 0}, "local_updates"),
    ],
)
def test_params_are_validated(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DaflParams(**kwargs)


def test_integer_params_must_be_integers() -> None:
    with pytest.raises(ValueError, match="step"):
        DaflParams(step=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_updates"):
        DaflParams(local_updates=2.0)  # type: ignore[arg-type]


def test_class_without_samples_is_rejected() -> None:
    with pytest.raises(ValueError, match="class 1 has no samples"):
        plan_dafl([[3, 0], [2, 0]])
    with pytest.raises(ValueError, match="class 1 has no samples"):
        plan_local_balancing([[3, 0], [2, 0]])


def test_larger_step_still_meets_tau() -> None:
    counts = partition("D5")
    plan = plan_dafl(counts, DaflParams(step=50))
    assert plan.J_after <= 1e-3
    assert np.all(plan.A % 50 == 0)
