"""How long DAFL planning (Algorithm 1) takes: the compiled planner against the one it replaced on
the paper's partitions, and the compiled planner as K and C grow.

Run: ``PYTHONPATH=src python benchmarks/dafl_planner.py [--budget SECONDS] [--seed N] [--repeats R]``

Table II part: every D1-D6 x lambda2 case planned by the previous planner (kept in
``tests/dafl_legacy.py``) and by the compiled one with its ``exact`` rule (which must give the
identical matrix: the table says so per case) and its default ``float`` rule; CPU seconds are the
minimum of ``--repeats`` runs, all in this one process, after one warm-up call that loads the
compiled kernel.

Scaling part: Dirichlet-skewed count matrices for K in {8, 100, 1000} x C in {8, 100}. The number of
Phase 1 steps is known before planning (it depends only on the class totals), so the time a
configuration would take at ``s = 1`` is estimated up front; a configuration whose estimate exceeds
``--budget`` is run with the smallest step from 1, 10, 100, 1000 that fits instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from felix.strategies.dataplans.dafl import DaflParams, phase1_steps, plan_dafl
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dafl_legacy import legacy_plan  # the previous planner, kept for the tests

STEPS = (1, 10, 100, 1000)
#: Rough cost model of the compiled planner per greedy step: fixed, per client row, per class.
STEP_OVERHEAD_S = 0.3e-6
ROW_COST_S = 5e-9
CLASS_COST_S = 30e-9


def skewed_counts(clients: int, classes: int, seed: int) -> NDArray[np.int64]:
    """A client x class count matrix with both kinds of imbalance DAFL targets.

    Class popularity is drawn once (Dirichlet(1), so some classes are rare
    everywhere: high J), each client's mix is a Dirichlet around it (label
    proportion imbalance I, many empty cells), and client sizes vary 20-fold.
    Classes that end up empty get one sample so that the problem is solvable.
    """
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.ones(classes))
    sizes = rng.integers(50, 1000, size=clients)
    counts = np.stack(
        [rng.multinomial(size, rng.dirichlet(0.5 * classes * popularity + 1e-3)) for size in sizes]
    )
    for c in np.flatnonzero(counts.sum(axis=0) == 0):
        counts[rng.integers(clients), c] += 1
    return counts.astype(np.int64)


def estimate_seconds(counts: NDArray[np.int64], params: DaflParams) -> tuple[int, float]:
    """Phase 1 steps and a rough CPU time for them. Phase 2's length is not known in advance
    (on the random matrices it can be as long as Phase 1), so real times can exceed this."""
    steps = phase1_steps(counts.sum(axis=0), params.step, params.tau, max_steps=10**12)
    rows, classes = counts.shape
    return steps, steps * (STEP_OVERHEAD_S + rows * ROW_COST_S + classes * CLASS_COST_S)


def cpu_seconds(fn, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    """Minimum CPU seconds of ``repeats`` calls of ``fn`` and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return best, result


def table_ii(repeats: int) -> None:
    print(
        "Table II partitions, paper settings (tau = epsilon = 1e-3, lambda1 = 1, s = 1); CPU ms, min of "
        f"{repeats}"
    )
    print(
        f"{'case':<12} {'old ms':>8} {'exact ms':>9} {'float ms':>9} {'speed-up':>9} {'identical':>9} "
        f"{'added (exact)':>13} {'added (float)':>13} {'I after (float)':>15}"
    )
    plan_dafl([[2, 1], [1, 1]])  # load the compiled kernel
    worst = 0.0
    for lambda2 in (1e2, 1e3, 1e4):
        for name in DATASET_NAMES:
            counts = partition(name)
            exact_params = DaflParams(lambda2=lambda2, rule="exact")
            old_s, old = cpu_seconds(partial(legacy_plan, counts, exact_params), max(1, repeats // 3))
            exact_s, exact = cpu_seconds(partial(plan_dafl, counts, exact_params), repeats)
            float_s, flt = cpu_seconds(partial(plan_dafl, counts, DaflParams(lambda2=lambda2)), repeats)
            same = exact.A.tolist() == old.tolist()  # type: ignore[union-attr]
            worst = max(worst, exact_s, float_s)
            print(
                f"{name} {lambda2:<9g} {1e3 * old_s:>8.1f} {1e3 * exact_s:>9.1f} {1e3 * float_s:>9.1f} "
                f"{old_s / max(exact_s, 1e-9):>8.0f}x {'yes' if same else 'NO':>9} "
                f"{exact.added:>13,} {flt.added:>13,} {flt.I_after:>15.4f}",
                flush=True,
            )  # type: ignore[union-attr]
    print(f"slowest compiled case: {1e3 * worst:.1f} ms CPU (aim: 50 ms)")


def scaling(seed: int, budget: float) -> None:
    print()
    print(f"Dirichlet-skewed random matrices (seed {seed}), lambda2 = 100, tau = 1e-3, rule float")
    print(
        f"{'K':>5} {'C':>4} {'n':>8} {'s':>5} {'steps':>9} {'added':>9} {'J0':>7} {'I0':>7} {'I_after':>7} "
        f"{'cpu_s':>8} {'us/step':>7}"
    )
    for clients in (8, 100, 1000):
        for classes in (8, 100):
            counts = skewed_counts(clients, classes, seed)
            for step in STEPS:
                params = DaflParams(step=step)
                phase1, estimate = estimate_seconds(counts, params)
                if estimate <= budget:
                    cpu, plan = cpu_seconds(partial(plan_dafl, counts, params, max_steps=10**9), 1)
                    steps = plan.added // step  # type: ignore[union-attr]
                    print(
                        f"{clients:>5} {classes:>4} {int(counts.sum()):>8} {step:>5} {steps:>9,} "
                        f"{plan.added:>9,} {plan.J_before:>7.4f} {plan.I_before:>7.4f} "  # type: ignore[union-attr]
                        f"{plan.I_after:>7.4f} {cpu:>8.3f} {1e6 * cpu / max(steps, 1):>7.2f}",  # type: ignore[union-attr]
                        flush=True,
                    )
                    break
                print(
                    f"{clients:>5} {classes:>4} {int(counts.sum()):>8} {step:>5} {phase1:>9,}  skipped: "
                    f"~{estimate:.0f} s CPU estimated for Phase 1 alone (budget {budget:g} s)",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=float, default=30.0, help="largest estimated seconds per configuration"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random count matrices")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats per Table II case (min is shown)"
    )
    parser.add_argument("--skip-table-ii", action="store_true", help="only the scaling part")
    args = parser.parse_args()
    if not args.skip_table_ii:
        table_ii(args.repeats)
    scaling(args.seed, args.budget)


if __name__ == "__main__":
    main()
