"""The simulator's time on the dp-* comparisons' runs (10,000 clients), and a digest of what they
computed, to compare two versions of the code side by side.

    PYTHONPATH=<source> python benchmarks/dp_run_speed.py [--comparison dp-fmnist-90] \
        [--variants felix-eps8 "oort*-eps8"] [--aggregations 30] [--threads 1]

Each variant runs once in this process, capped at ``--aggregations``, after the data and the
model are built (so the numbers are the event loop's: selection, dispatch, training, the
mechanisms, aggregation and evaluation). Prints one JSON line per variant: CPU and wall seconds of
``Simulation.run``, and a SHA-256 of the final model's weights and of every evaluation's
(version, accuracy, loss, epsilon), which must match between versions that claim the same results.
Run it with one source tree, then the other, alternating, on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np

from felix.experiments.compare import load_comparison, variant_config
from felix.metrics.provenance import provenance
from felix.sim.build import build


def one(comparison: str, variant: str, aggregations: int, threads: int) -> dict[str, object]:
    comp = load_comparison(comparison)
    sets = {"run": {"max_aggregations": aggregations, "threads": threads}}
    cfg = variant_config(comp, variant, sets, seed=0, stop_target=max(comp.targets or [0.7]))
    built = build(cfg)
    cpu, wall = time.process_time(), time.perf_counter()
    built.sim.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rows = [(r.version, r.accuracy, r.loss, getattr(r, "epsilon", None)) for r in built.recorder.rows]
    weights = np.ascontiguousarray(built.orch.weights, dtype=np.float32)
    return {
        "comparison": comparison,
        "variant": variant,
        "aggregations": int(built.orch.version),
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "weights_sha256": hashlib.sha256(weights.tobytes()).hexdigest(),
        "evaluations_sha256": hashlib.sha256(repr(rows).encode()).hexdigest(),
        "final_accuracy": rows[-1][1] if rows else None,
        "commit": (provenance().get("git") or {}).get("commit"),  # None outside a checkout
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comparison", default="dp-fmnist-90")
    ap.add_argument("--variants", nargs="+", default=["felix-eps8", "oort*-eps8"])
    ap.add_argument("--aggregations", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (run.threads)")
    args = ap.parse_args()
    for v in args.variants:
        print(json.dumps(one(args.comparison, v, args.aggregations, args.threads)), flush=True)


if __name__ == "__main__":
    main()
