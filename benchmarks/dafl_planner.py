"""How long DAFL planning (Algorithm 1) takes, on the paper's partitions and as K and C grow.

Run: ``PYTHONPATH=src python benchmarks/dafl_planner.py [--budget SECONDS] [--seed N]``

Each greedy step adds ``s`` samples, and the number of Phase 1 steps is known
before planning starts (it depends only on the class totals), so the time a
configuration would take at ``s = 1`` can be estimated up front. Configurations
whose estimate exceeds ``--budget`` are not run at ``s = 1``; the table says so
and reports the smallest step ``s`` from 1, 10, 100, 1000 that fits instead.
Both wall-clock and CPU seconds are printed: a loaded machine inflates the first.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numpy.typing import NDArray

from felix.data.dafl import DaflParams, _water_fill, plan_dafl
from felix.data.dafl_tables import DATASET_NAMES, partition

STEPS = (1, 10, 100, 1000)
#: Rough cost model for the estimate: fixed numpy overhead per step plus per cell of the K x C matrix.
STEP_OVERHEAD_S = 25e-6
CELL_COST_S = 4e-9


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
    """Phase 1 steps and a rough CPU time for them. Phase 2's length is not known in
    advance: on the paper's partitions it is short except for D3, on the random
    matrices it can be longer than Phase 1 (small clients absorb samples that
    dilute the skewed ones), so real times can exceed the estimate."""
    steps = _water_fill(counts.sum(axis=0), params.step, params.tau).size
    return steps, steps * (STEP_OVERHEAD_S + counts.size * CELL_COST_S)


def row(label: str, counts: NDArray[np.int64], params: DaflParams) -> str:
    """One table line; CPU time is shown beside wall time because a loaded machine inflates the latter."""
    cpu = time.process_time()
    plan = plan_dafl(counts, params)
    cpu = time.process_time() - cpu
    steps = plan.added // params.step
    per_step = 1e6 * cpu / max(steps, 1)
    return (
        f"{label:<14} {counts.shape[0]:>5} {counts.shape[1]:>4} {int(counts.sum()):>8} {params.step:>5} "
        f"{steps:>8} {plan.added:>9} {plan.J_before:>7.4f} {plan.I_before:>7.4f} {plan.I_after:>7.4f} "
        f"{plan.plan_seconds:>8.3f} {cpu:>8.3f} {per_step:>7.1f}"
    )


HEADER = (
    f"{'case':<14} {'K':>5} {'C':>4} {'n':>8} {'s':>5} {'steps':>8} {'added':>9} {'J0':>7} {'I0':>7} "
    f"{'I_after':>7} {'wall_s':>8} {'cpu_s':>8} {'us/step':>7}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=float, default=60.0, help="largest estimated seconds per configuration"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random count matrices")
    args = parser.parse_args()

    print("Table II partitions, paper settings (tau = epsilon = 1e-3, lambda1 = 1, s = 1)")
    print(HEADER)
    for lambda2 in (1e2, 1e3, 1e4):
        for name in DATASET_NAMES:
            print(row(f"{name} l2={lambda2:g}", partition(name), DaflParams(lambda2=lambda2)), flush=True)

    print()
    print(f"Dirichlet-skewed random matrices (seed {args.seed}), lambda2 = 100, tau = 1e-3")
    print(HEADER)
    for clients in (8, 100, 1000):
        for classes in (8, 100):
            counts = skewed_counts(clients, classes, args.seed)
            for step in STEPS:
                params = DaflParams(step=step)
                phase1, estimate = estimate_seconds(counts, params)
                if estimate <= args.budget:
                    print(row(f"random s={step}", counts, params), flush=True)
                    break
                print(
                    f"{'random':<14} {clients:>5} {classes:>4} {int(counts.sum()):>8} {step:>5} {phase1:>8} "
                    f"  skipped: ~{estimate:.0f} s CPU estimated for Phase 1 alone (budget {args.budget:g} s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
