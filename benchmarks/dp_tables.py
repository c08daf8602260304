"""docs/privacy.md's price-of-privacy tables, from a dp-* comparison's committed ``comparison.json``.

    python benchmarks/dp_tables.py docs/results/comparisons/dp-fmnist-90/comparison.json \
        docs/results/comparisons/dp-fmnist-90-oort-reports/comparison.json

Several files are parts of one comparison (some variants rerun into another folder): the tables
read their union, a later file's variants replacing an earlier one's.

Prints Markdown tables, strategies by epsilon (the variants are named ``<strategy>-eps<e>``): the
last evaluation's accuracy, mean +- sd over the seeds (and the epsilon the runs spent); the virtual
time to each of the comparison's targets (mean +- sd over the seeds that reached it, and how many
did); and felix's accuracy minus each other strategy's, paired by seed (mean, min..max), at each
epsilon. The tables are ``felix.experiments.price_of_privacy``'s, as ``felix report`` shows them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from felix.experiments.price_of_privacy import accuracy_table, grid, paired_table, time_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("comparison", nargs="+", help="comparison.json files written by felix compare")
    a = ap.parse_args()
    doc: dict[str, Any] = {}
    for path in a.comparison:
        part = json.loads(Path(path).read_text())
        if doc and (part["name"], part["targets"], part["target_window"]) != (
            doc["name"],
            doc["targets"],
            doc["target_window"],
        ):
            raise SystemExit(
                f"{path}: not a part of {a.comparison[0]}'s comparison (name, targets, target rule)"
            )
        doc = {
            **part,
            "runs": {**doc.get("runs", {}), **part["runs"]},
            "stats": {**doc.get("stats", {}), **part["stats"]},
        }
    g = grid(doc["runs"])
    print("Accuracy of the last evaluation, mean ± sd over seeds (ε: the largest spent):\n")
    print("\n".join(accuracy_table(g).markdown()))
    for target in doc["targets"]:
        print(f"\nVirtual seconds to {target} (mean of the last {doc['target_window']} evaluations):\n")
        print("\n".join(time_table(g, doc["stats"], str(target)).markdown()))
    ends = sorted({r["aggregations"] for seeds in doc["runs"].values() for r in seeds.values()})
    at = f"{ends[0]}" if len(ends) == 1 else f"{ends[0]}-{ends[-1]}"
    print(
        "\nfelix's last-evaluation accuracy minus the strategy's, paired by seed (mean [min..max]), "
        f"at the runs' ends ({at} aggregations):\n"
    )
    print("\n".join(paired_table(g).markdown()))


if __name__ == "__main__":
    main()
