"""The accountant's cost per aggregation, amortised over a run of N aggregations, for three noise
multipliers: each aggregation is counted (``RdpAccountant.step``) and epsilon is read every
``--read-every`` aggregations (1: an evaluation after every version, the worst case; 10: a typical
``run.eval_every``).

    python benchmarks/privacy_accountant.py [--aggregations 2000] [--repeats 3] [--read-every 1]
        [--mechanism central_gaussian] [--max-participations M] [--bands B] [--accountant rdp]

Prints milliseconds per aggregation (best and median of the repeats) as JSON with provenance;
the budget is 1 ms per aggregation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from felix.metrics.provenance import provenance
from felix.privacy.accountant import Accountant


def per_aggregation_ms(sigma: float, n: int, read_every: int, args: argparse.Namespace) -> float:
    acc = Accountant(
        args.mechanism,
        sigma,
        1e-5,
        kind=args.accountant,
        max_participations=args.max_participations,
        bands=args.bands,
    )
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        acc.step()
        if i % read_every == 0:
            acc.epsilon  # noqa: B018 - the read is what is timed
    return (time.perf_counter() - t0) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aggregations", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--read-every", type=int, default=1)
    ap.add_argument(
        "--mechanism", default="central_gaussian", choices=("central_gaussian", "dp_ftrl", "banded_mf")
    )
    ap.add_argument("--max-participations", type=int, default=None)
    ap.add_argument("--bands", type=int, default=None, help="banded_mf's bands")
    ap.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    args = ap.parse_args()
    rows = []
    for sigma in (0.5, 1.0, 4.0):
        times = [
            per_aggregation_ms(sigma, args.aggregations, args.read_every, args) for _ in range(args.repeats)
        ]
        rows.append(
            {
                "mechanism": args.mechanism,
                "accountant": args.accountant,
                "max_participations": args.max_participations,
                "bands": args.bands,
                "noise_multiplier": sigma,
                "aggregations": args.aggregations,
                "read_every": args.read_every,
                "ms_per_aggregation_min": round(min(times), 4),
                "ms_per_aggregation_median": round(statistics.median(times), 4),
            }
        )
    print(json.dumps({"rows": rows, "provenance": provenance({"threads": 1})}, indent=2))


if __name__ == "__main__":
    main()
