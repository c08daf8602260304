"""One simulated run's cohorts in this process (``run.executor: local``) against two Ray CPU actors
(``run.executor: ray``), side by side and repeated (issue 14, deliverable 2).

Run: ``PYTHONPATH=src python benchmarks/cohort_executor.py [--repeats 3] [--aggregations 8] [--clients 100]
[--goal 32] [--model small_cnn] [--actors 2] [--epochs 5] [--batch-size 8]``

One local Ray instance with 2 CPUs serves every repeat (its start-up is timed on its own). Per repeat,
in alternating order: the run with the local cohort path, and the same run with its cohorts split
over ``--actors`` actors (their start, inside ``build``, timed on its own). Both use ``run.threads = 1``
and the same seed; it checks that the summaries are identical apart from wall time and the run
settings, and prints per side the simulation's wall time and the seconds inside training (min and
median over repeats), the median time of a cohort after the run's first (the actors' warm-up), the
ratios, and the load average: on a shared machine the ratio is what it is
at that load, not what an idle one would give.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from felix.config import deep_merge
from felix.engine.setup import resolve_config
from felix.sim.run import run_config

VARIES = ("wall_time_s", "provenance")


def time_cohorts(built: Any, into: list[float]) -> float:
    """Wraps the run's cohort executor to time each cohort after the first (warm-up); returns now."""
    train = built.sim.cohort.train
    calls = [0]

    def timed(tasks: list[Any]) -> Any:
        t0 = time.perf_counter()
        out = train(tasks)
        calls[0] += 1
        if calls[0] > 1:
            into.append(time.perf_counter() - t0)
        return out

    built.sim.cohort.train = timed
    return time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--aggregations", type=int, default=8)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--goal", type=int, default=32, help="FedAvg's clients per round (the cohort size)")
    ap.add_argument("--model", default="small_cnn", choices=("small_cnn", "mlp"))
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5, help="local epochs: the work per task")
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import ray

    from felix.distributed import ray_runtime

    base: dict[str, Any] = {
        "model": args.model,
        "partition": {"num_clients": args.clients},
        "orchestrator": {"agg_goal": args.goal},
        "client": {"epochs": args.epochs, "batch_size": args.batch_size},
        "run": {"max_aggregations": args.aggregations, "stop_at_target": False, "cohort": 64, "threads": 1},
    }
    local_cfg = resolve_config(None, "fedavg", base)
    ray_cfg = resolve_config(
        None, "fedavg", deep_merge(base, {"run": {"executor": "ray", "ray_actors": args.actors}})
    )
    t0 = time.perf_counter()
    ray_runtime.start_local(num_cpus=2)
    ray_start = time.perf_counter() - t0
    run_config(local_cfg, plots=False)  # warm this process up: the kindest baseline for the local side
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    trains: dict[str, list[float]] = {"local": [], "ray": []}
    builds: list[float] = []
    cohorts: dict[str, list[float]] = {"local": [], "ray": []}  # seconds per cohort after a run's first
    summaries: dict[str, dict[str, Any]] = {}
    try:
        for r in range(args.repeats):
            for side in ("local", "ray") if r % 2 == 0 else ("ray", "local"):
                t0 = time.perf_counter()
                built_at: list[float] = []
                res = run_config(
                    local_cfg if side == "local" else ray_cfg,
                    plots=False,
                    prepare=lambda b, at=built_at, s=side: at.append(time_cohorts(b, cohorts[s])),
                )
                if side == "ray":
                    builds.append(built_at[0] - t0)
                outcome_wall = res.summary["wall_time_s"]
                walls[side].append(outcome_wall)
                trains[side].append(res.built.sim._train_seconds)
                summaries[side] = {k: v for k, v in res.summary.items() if k not in VARIES}
                print(
                    f"repeat {r} {side:5s}: wall {outcome_wall:7.2f} s, training {trains[side][-1]:7.2f} s",
                    flush=True,
                )
            if summaries["local"] != summaries["ray"]:
                diff = sorted(
                    k for k in summaries["local"] if summaries["local"][k] != summaries["ray"].get(k)
                )
                raise SystemExit(f"summaries differ in {diff}")
    finally:
        ray.shutdown()

    def stats(xs: list[float]) -> str:
        return f"min {min(xs):7.2f}  median {statistics.median(xs):7.2f}"

    print(
        f"\n{args.model}, {args.clients} clients, FedAvg {args.goal} per round, {args.epochs} epochs of batch "
        f"{args.batch_size}, {args.aggregations} aggregations, "
        f"{args.repeats} repeats; summaries identical (apart from wall time)"
    )
    print(f"Ray start-up {ray_start:.2f} s; {args.actors} actors' start (in build) {stats(builds)}")
    for side in ("local", "ray"):
        print(f"{side:5s} wall {stats(walls[side])} | training {stats(trains[side])}")
    print(
        f"per cohort after the first: local median {statistics.median(cohorts['local']):.3f} s, ray median "
        f"{statistics.median(cohorts['ray']):.3f} s ({len(cohorts['ray'])} cohorts)"
    )
    print(
        f"ray / local wall: min {min(walls['ray']) / min(walls['local']):.2f}, median "
        f"{statistics.median(walls['ray']) / statistics.median(walls['local']):.2f}; training: min "
        f"{min(trains['ray']) / min(trains['local']):.2f}"
    )
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
