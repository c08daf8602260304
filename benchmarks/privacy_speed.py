"""The CPU cost of privacy: the same run with privacy off and on, side by side, in this process's
CPU time (training, aggregation, the mechanism, the devices' clipping and noising, the accountant
read at every evaluation).

    python benchmarks/privacy_speed.py [--scenario felix-cpu-100] [--strategy felix] \
        [--aggregations 40] [--repeats 3] [--threads 1] [--mechanism dp_ftrl]

Both sides divide by the buffer size (``aggregator.normalize: count``, which privacy requires), so
privacy is the only difference; the losses and utilities the clients report (probes included) are
made private too (``privacy.reports``) when the strategy reads them. Runs alternate off / on, ``--repeats`` times, after one warm-up of
each. Prints JSON: CPU seconds per run (min and median), the ratio on / off of each, and
provenance. The budget is a ratio of at most 1.05.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from felix.engine.setup import resolve_config
from felix.metrics.provenance import provenance
from felix.privacy.config import report_readers
from felix.sim.build import build

PRIVACY: dict[str, dict[str, Any]] = {
    "central_gaussian": {"mechanism": "central_gaussian", "noise_multiplier": 1.0, "clip_norm": 1.0},
    "dp_ftrl": {"mechanism": "dp_ftrl", "noise_multiplier": 1.0, "clip_norm": 1.0, "max_participations": 50},
    "banded_mf": {
        "mechanism": "banded_mf",
        "bands": 4,
        "noise_multiplier": 1.0,
        "clip_norm": 1.0,
        "max_participations": 50,
    },
    "local": {"mechanism": "local", "noise_multiplier": 0.1, "clip_norm": 1.0, "max_participations": 50},
}


def cpu_seconds(args: argparse.Namespace, private: bool, aggregations: int) -> tuple[float, int]:
    sets: dict[str, Any] = {
        "run": {"max_aggregations": aggregations, "stop_at_target": False, "threads": args.threads},
        "aggregator": {"normalize": "count"},
    }
    cfg = resolve_config(None, args.strategy, sets, args.scenario)
    if private:
        privacy = dict(PRIVACY[args.mechanism])
        if report_readers(cfg):
            privacy["reports"] = {"noise_multiplier": 1.0, "clip": 10.0, "max_per_client": 1000}
        cfg = resolve_config(None, args.strategy, {**sets, "privacy": privacy}, args.scenario)
    built = build(cfg)
    t0 = time.process_time()
    out = built.sim.run()
    assert not out.rejected, f"{len(out.rejected)} updates rejected: the sides would differ in work"
    return time.process_time() - t0, int(built.orch.stats.updates_applied)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="felix-cpu-100")
    ap.add_argument("--strategy", default="felix")
    ap.add_argument("--mechanism", default="dp_ftrl", choices=sorted(PRIVACY))
    ap.add_argument("--aggregations", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (run.threads)")
    args = ap.parse_args()
    cpu_seconds(args, False, 3)  # warm-up: first-call costs of torch, the data and the library
    cpu_seconds(args, True, 3)
    off: list[float] = []
    on: list[float] = []
    updates: dict[str, list[int]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        t, n = cpu_seconds(args, False, args.aggregations)
        off.append(t)
        updates["off"].append(n)
        t, n = cpu_seconds(args, True, args.aggregations)
        on.append(t)
        updates["on"].append(n)
    result = {
        "scenario": args.scenario,
        "strategy": args.strategy,
        "mechanism": args.mechanism,
        "aggregations": args.aggregations,
        "repeats": args.repeats,
        "cpu_s_off": [round(x, 3) for x in off],
        "cpu_s_on": [round(x, 3) for x in on],
        "updates_applied": updates,
        "ratio_min": round(min(on) / min(off), 4),
        "ratio_median": round(statistics.median(on) / statistics.median(off), 4),
        "provenance": provenance({"threads": args.threads}),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
