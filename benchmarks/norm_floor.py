"""Honest update norms over a long run, against the validator's norm bound (``felix.core.validation``).

The bound is ``norm_factor`` x the median of recently accepted ``norm / sqrt(steps)``. As the model
converges the updates shrink, and so does the median: late in a long run an honest client whose
update is still large (a client with unusual data, a stale task) was rejected. ``norm_floor`` keeps
the median from counting below a fraction of its peak. This script simulates a scenario with every
client honest and records, for every training update the validator sees: the median and its peak
at that moment, the update's ``norm / sqrt(steps)``, and whether it was rejected (every rejection
of an honest update is a false one). It prints one JSON line per run::

    python benchmarks/norm_floor.py --scenario felix-cpu-100 --preset felix --aggregations 400 \
        --seeds 0 1 2 --floors 0 0.1

Fields: ``updates``, ``false_rejections``, ``peak`` (highest median), ``final_median``,
``median_to_peak_min`` (how far the median fell), ``max_ratio`` (largest update / median at the
time: what the factor must exceed with no floor) and ``max_ratio_floored`` (largest update /
max(median, floor x peak)).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from felix.core.types import TaskKind
from felix.core.validation import UpdateValidator, Verdict, l2_norm
from felix.engine.setup import resolve_config
from felix.sim.build import Built
from felix.sim.run import run_config


def instrument(v: UpdateValidator, log: list[dict[str, float]]) -> None:
    """Record every training update's ratio to the median before ``check`` sees it."""
    check = v.check

    def recorded(client_id: int, kind: TaskKind, upd: Any, *args: Any) -> Verdict:
        c = v.config
        if kind is TaskKind.TRAIN and upd.delta is not None and len(v.norms) >= c.norm_min_history:
            median = v.updates.median()
            rel = l2_norm(upd.delta) / math.sqrt(v.local_steps(upd.num_samples))
            verdict = check(client_id, kind, upd, *args)
            log.append(
                {
                    "median": median,
                    "peak": v.peak,
                    "rel": rel,
                    "rejected": float(verdict.update is None and "norm" in verdict.reason),
                }
            )
            return verdict
        return check(client_id, kind, upd, *args)

    v.check = recorded  # type: ignore[method-assign]


def run(scenario: str, preset: str, aggregations: int, seed: int, floor: float) -> dict[str, Any]:
    cfg = resolve_config(
        None,
        preset,
        {
            "seed": seed,
            "validation": {"norm_floor": floor},
            "run": {"max_aggregations": aggregations, "eval_every": 0, "target_accuracy": 1.0},
        },
        scenario=scenario,
    )
    log: list[dict[str, float]] = []

    def prepare(b: Built) -> None:
        instrument(b.orch.validator, log)

    t0 = time.monotonic()
    res = run_config(cfg, plots=False, prepare=prepare)
    if not log:
        raise RuntimeError("no training update reached the validator's median rule")
    floored = [r["rel"] / max(r["median"], floor * r["peak"]) for r in log]
    return {
        "scenario": scenario,
        "preset": preset,
        "seed": seed,
        "norm_floor": floor,
        "aggregations": res.summary.get("aggregations", res.built.orch.version),
        "updates": len(log),
        "false_rejections": int(sum(r["rejected"] for r in log)),
        "peak": max(r["peak"] for r in log),
        "final_median": log[-1]["median"],
        "median_to_peak_min": min(r["median"] / r["peak"] for r in log if r["peak"] > 0),
        "max_ratio": max(r["rel"] / r["median"] for r in log),
        "max_ratio_floored": max(floored),
        "wall_s": round(time.monotonic() - t0, 1),
        "torch": torch.__version__,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="felix-cpu-100")
    p.add_argument("--preset", default="felix")
    p.add_argument("--aggregations", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--floors", type=float, nargs="+", default=[0.0, 0.1])
    args = p.parse_args()
    for seed in args.seeds:
        for floor in args.floors:
            print(json.dumps(run(args.scenario, args.preset, args.aggregations, seed, floor)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
