"""Table III of the DAFL paper, the two planner rules, the compiled kernel's equivalence with the
planner it replaced, its speed, and its bounds on large counts."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from dafl_legacy import legacy_plan

from felix.strategies.dataplans import dafl_kernel
from felix.strategies.dataplans.dafl import (
    MAX_COUNT,
    DaflParams,
    PlanTooLargeError,
    max_total_samples,
    phase1_steps,
    plan_dafl,
    plan_local_balancing,
)
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition
from felix.strategies.dataplans.imbalance import global_class_imbalance

# (partition, lambda2) -> (samples added, I after), rule "float" (the default), s = 1, tau = 1e-3.
# Published in the paper's Table III and quoted in issue 13: D3 at 1e2 adds 39,060; D2 at 1e4 leaves
# I = .0798 and D5 at 1e4 I = .0703. The other cells are the plans the float rule gives; the exact
# rule gives the same counts and I except D3 at 1e2 (39,018, I .0558; see test_rules_differ_on_d3).
TABLE_III = {
    ("D1", 1e2): (24909, 0.0001),
    ("D1", 1e3): (24909, 0.0001),
    ("D1", 1e4): (24909, 0.0001),
    ("D2", 1e2): (24913, 0.1479),
    ("D2", 1e3): (24913, 0.1479),
    ("D2", 1e4): (24911, 0.0798),
    ("D3", 1e2): (39060, 0.0558),
    ("D3", 1e3): (3080, 0.2836),
    ("D3", 1e4): (7, 0.3492),
    ("D4", 1e2): (24085, 0.0817),
    ("D4", 1e3): (24085, 0.0817),
    ("D4", 1e4): (24080, 0.0472),
    ("D5", 1e2): (21014, 0.1349),
    ("D5", 1e3): (21014, 0.1349),
    ("D5", 1e4): (21015, 0.0703),
    ("D6", 1e2): (18368, 0.1653),
    ("D6", 1e3): (18367, 0.1653),
    ("D6", 1e4): (18367, 0.1260),
}


@pytest.mark.parametrize(("name", "lambda2"), sorted(TABLE_III))
def test_table_iii(name: str, lambda2: float) -> None:
    plan = plan_dafl(partition(name), DaflParams(lambda2=lambda2))
    added, i_after = TABLE_III[(name, lambda2)]
    assert plan.added == added
    assert plan.I_after == pytest.approx(i_after, abs=5e-5)
    assert plan.J_after <= 1e-3 < plan.J_before


def test_rules_differ_on_d3() -> None:
    # At step 12,509 of D3 (lambda2 = 100) a move reaches J = 1/1000 exactly: the exact rule accepts it,
    # the float J is a hair above tau and refuses it, as the paper's arithmetic does.
    exact = plan_dafl(partition("D3"), DaflParams(rule="exact"))
    assert exact.added == 39018
    assert exact.I_after == pytest.approx(0.0558, abs=5e-5)
    with pytest.raises(ValueError, match="rule"):
        DaflParams(rule="fuzzy")  # type: ignore[arg-type]


def test_j_float_is_the_reported_j() -> None:
    # The float rule decides J <= tau on the very value the plan reports as J_after.
    rng = np.random.default_rng(7)
    for _ in range(200):
        counts = rng.integers(1, 10 ** int(rng.integers(1, 7)), size=(1, int(rng.integers(1, 120))))
        totals = counts[0]
        assert dafl_kernel.j_float(totals, -1, 0, int(totals.sum())) == global_class_imbalance(counts)


def test_kernel_fsum_is_math_fsum() -> None:
    rng = np.random.default_rng(3)
    for size in (1, 2, 7, 8, 9, 64, 1000):
        values = rng.random(size) * 10.0 ** rng.integers(-8, 8, size=size)
        assert dafl_kernel.fsum(values, size) == math.fsum(values)


def test_kernel_running_sum_stays_math_fsum() -> None:
    # The greedy keeps sum_k Q_k / n_k exact in partials while one term at a time is replaced.
    rng = np.random.default_rng(4)
    values = rng.random(300) * 10.0 ** rng.integers(-3, 9, size=300)
    partials = np.empty(64)
    n = 0
    for v in values:
        n = dafl_kernel.msum_add(partials, n, v)
    for _ in range(3000):
        k = int(rng.integers(values.size))
        n = dafl_kernel.msum_add(partials, n, -values[k])
        values[k] = rng.random() * 10.0 ** int(rng.integers(-3, 9))
        n = dafl_kernel.msum_add(partials, n, values[k])
        assert dafl_kernel.msum_round(partials, n) == math.fsum(values)


# ---------------------------------------------------------------------------
# Identical plans to the planner the kernel replaced (rule "exact")
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_exact_rule_plans_like_the_old_planner(seed: int) -> None:
    rng = np.random.default_rng(5000 + seed)
    for _ in range(12):
        shape = (int(rng.integers(1, 30)), int(rng.integers(2, 12)))
        counts = rng.integers(0, rng.choice([5, 30, 200]), size=shape) * (rng.random(shape) < 0.8)
        counts[rng.integers(shape[0]), counts.sum(axis=0) == 0] = 1
        params = DaflParams(
            lambda1=float(rng.choice([1.0, 0.5, 0.0])),
            lambda2=float(rng.choice([0.0, 1.0, 100.0, 1e4])),
            tau=float(rng.choice([1e-3, 1e-2, 0.05])),
            step=int(rng.choice([1, 1, 2, 3])),
            zeta_prime=float(rng.choice([2.0, 0.1])),
            local_updates=int(rng.choice([2, 2, 1, 3])),
            smoothness=float(rng.choice([1.0, 1.0, 25.0])),
            rule="exact",
        )
        assert plan_dafl(counts, params).A.tolist() == legacy_plan(counts, params).tolist(), (
            counts.tolist(),
            params,
        )


# ---------------------------------------------------------------------------
# The float rule against a plain Python reading of it
# ---------------------------------------------------------------------------


def reference_float(counts: np.ndarray, prm: DaflParams) -> np.ndarray:
    """Algorithm 1 with the float rule, in plain Python: every candidate's P from the
    incremental formula, J from global_class_imbalance, strict argmin in row-major order."""
    s, rows = prm.step, np.flatnonzero(counts.sum(axis=1) > 0)
    x = counts[rows].astype(np.int64)
    a = np.zeros_like(x)
    alpha, beta, kappa = prm.lambda1 * prm.zeta_prime / prm.epsilon, prm.lambda2 * prm.zeta, prm.drift_weight

    def j_of(m: np.ndarray) -> float:
        return global_class_imbalance(m)

    def p_of(k: int, c: int) -> float:
        m = x + a
        sizes, totals = m.sum(axis=1), m.sum(axis=0)
        n, s2 = int(totals.sum()), int((totals * totals).sum())
        ratio = [float(int((r * r).sum())) / float(int(r.sum())) for r in m]
        inv = 1.0 / float(n + s)
        kappa_n = kappa * inv
        shared = 1.0 + kappa_n * (math.fsum(ratio) - float(s2 + s * s) * inv)
        slope = float(2 * s) * kappa_n
        q = int((m[k] * m[k]).sum())
        delta = float(q + s * s) / float(int(sizes[k]) + s) - ratio[k]
        max_size, max_aug = int(sizes.max()), int(a.sum(axis=1).max())
        width = max(alpha * float(int(sizes[k]) + s), alpha * float(max_size))
        extra = max(beta * float(int(a[k].sum()) + s), beta * float(max_aug))
        h = float(m[k, c]) / float(int(sizes[k]) + s) - float(totals[c]) * inv
        return width * (delta * kappa_n + shared + slope * h) + extra

    def best(classes: list[int]) -> tuple[float, int, int]:
        top = (math.inf, -1, -1)
        for k in range(len(x)):
            for c in classes:
                if x[k, c] > 0:
                    value = p_of(k, c)
                    if value < top[0]:
                        top = (value, k, c)
        return top

    while j_of(x + a) > prm.tau:
        totals = (x + a).sum(axis=0)
        _, k, c = best([c for c in range(x.shape[1]) if totals[c] == totals.min()])
        a[k, c] += s
    m = x + a
    totals = m.sum(axis=0)
    n = int(totals.sum())
    ratio = [float(int((r * r).sum())) / float(int(r.sum())) for r in m]
    imbalance = math.fsum(ratio) / float(n) - float(int((totals * totals).sum())) / float(n * n)
    current = alpha * float(int(m.sum(axis=1).max())) * (1.0 + kappa * imbalance) + beta * float(
        int(a.sum(axis=1).max())
    )
    while True:
        feasible = []
        for c in range(x.shape[1]):
            trial = x + a
            trial[0, c] += s  # J depends on the class totals only
            if j_of(trial) <= prm.tau:
                feasible.append(c)
        value, k, c = best(feasible)
        if k < 0 or not value < current:
            break
        a[k, c] += s
        current = value
    full = np.zeros_like(counts)
    full[rows] = a
    return full


@pytest.mark.parametrize("seed", range(2))
def test_float_rule_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(7000 + seed)
    for _ in range(15):
        shape = (int(rng.integers(1, 5)), int(rng.integers(2, 5)))
        counts = rng.integers(0, rng.choice([6, 12, 30]), size=shape) * (rng.random(shape) < 0.85)
        counts[rng.integers(shape[0]), counts.sum(axis=0) == 0] = 1
        params = DaflParams(
            lambda2=float(rng.choice([0.0, 1.0, 100.0, 1e4])),
            tau=float(rng.choice([1e-3, 1e-2, 0.05])),
            step=int(rng.choice([1, 1, 2, 3])),
            local_updates=int(rng.choice([2, 2, 1, 3])),
        )
        assert plan_dafl(counts, params).A.tolist() == reference_float(counts, params).tolist(), (
            counts.tolist(),
            params,
        )


# ---------------------------------------------------------------------------
# Speed and bounds
# ---------------------------------------------------------------------------


def test_table_ii_cases_plan_in_under_50_ms_of_cpu() -> None:
    plan_dafl([[2, 1], [1, 1]])  # compile or load the kernel once
    for rule in ("float", "exact"):
        for lambda2 in (1e2, 1e3, 1e4):
            for name in DATASET_NAMES:
                cpu = time.process_time()
                plan_dafl(partition(name), DaflParams(lambda2=lambda2, rule=rule))
                cpu = time.process_time() - cpu
                assert cpu <= 0.05, (name, lambda2, rule, cpu)


@pytest.mark.parametrize("big", [10**12, 2**63, 2**63 - 1, 2**64, 1e12, MAX_COUNT + 1])
def test_counts_above_the_maximum_name_the_cell(big: float) -> None:
    counts = [[5, 3, 2], [4, 1, big]]
    for plan in (plan_dafl, plan_local_balancing):
        with pytest.raises(ValueError, match=r"N\[1, 2\] = \d+ is above the maximum count 2147483647"):
            plan(counts)


def test_1e8_is_refused_up_front_and_planned_with_a_larger_step() -> None:
    counts = [[10**8, 1], [1, 1]]
    start = time.process_time()
    with pytest.raises(
        PlanTooLargeError, match="at least 88,103,302 greedy steps of 1 samples.*step of at least 9"
    ):
        plan_dafl(counts)
    with pytest.raises(PlanTooLargeError, match="client 0: balancing"):
        plan_local_balancing(counts)
    plan = plan_dafl(counts, DaflParams(step=100))
    assert time.process_time() - start < 5.0
    assert plan.J_after <= 1e-3 and math.isfinite(plan.I_after)
    assert plan.added % 100 == 0
    assert plan.A[:, 1].sum() >= 100 * phase1_steps([10**8 + 1, 2], 100, 1e-3) > 0


def test_work_bound_is_checked_up_front_and_while_planning() -> None:
    # D2 needs at least 24,495 Phase 1 steps by the lower bound, 24,913 in all.
    with pytest.raises(PlanTooLargeError, match="at least 24,495 greedy steps.*bound of 1,000 steps"):
        plan_dafl(partition("D2"), max_steps=1000)
    with pytest.raises(PlanTooLargeError, match="more than 24,500 greedy steps"):
        plan_dafl(partition("D2"), max_steps=24_500)
    # D3's Phase 1 is 7 steps; Phase 2 goes on for ~39k: stopped by the bound, never a partial plan.
    with pytest.raises(PlanTooLargeError, match="stopped after 100 greedy steps"):
        plan_dafl(partition("D3"), max_steps=100)
    with pytest.raises(ValueError, match="max_steps"):
        plan_dafl(partition("D3"), max_steps=0)


def test_sample_bound() -> None:
    # With C = 2 the planner holds at most max_total_samples(2) samples; many large cells exceed it.
    limit = max_total_samples(2)
    assert 2 * limit * limit < 2**62
    counts = np.full((1000, 2), MAX_COUNT)
    with pytest.raises(PlanTooLargeError, match="maximum of"):
        plan_dafl(counts)
