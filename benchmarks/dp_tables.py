"""docs/privacy.md's price-of-privacy tables, from a dp-* comparison's committed ``comparison.json``.

    python benchmarks/dp_tables.py docs/results/comparisons/dp-fmnist-90/comparison.json

Prints three Markdown tables, strategies by epsilon (the variants are named ``<strategy>-eps<e>``):
the last evaluation's accuracy, mean +- sd over the seeds (and the epsilon the runs spent); the
virtual time to each of the comparison's targets (mean +- sd over the seeds that reached it, and how
many did); and felix's accuracy minus each other strategy's, paired by seed (mean, min..max), at
each epsilon (without privacy the runs stop at the highest target, so there it compares nothing).
A variant not in the file is "not run".
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

STRATEGIES = ("felix", "felix-authors", "oort-async*", "fedbuff", "oort*", "fedavg")
EPSILONS = ("1", "2", "4", "8", "inf")


def mean_sd(xs: list[float], digits: int) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.{digits}f} ± {sd:.{digits}f}"


def header(first: str, epsilons: tuple[str, ...] = EPSILONS) -> list[str]:
    cols = [f"ε = {e}" if e != "inf" else "no DP (ε = ∞)" for e in epsilons]
    return [f"| {first} | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]


def accuracy_table(runs: dict[str, Any]) -> list[str]:
    out = header("strategy")
    for s in STRATEGIES:
        cells = []
        for e in EPSILONS:
            seeds = runs.get(f"{s}-eps{e}")
            if not seeds:
                cells.append("not run")
                continue
            acc = [r["final_accuracy"] for r in seeds.values()]
            cell = f"{mean_sd(acc, 3)} (n={len(acc)})"
            if e != "inf":
                eps = max(r["privacy"]["epsilon"] for r in seeds.values())
                cell += f", ε {eps:.2f}"
            cells.append(cell)
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return out


def time_table(stats: dict[str, Any], runs: dict[str, Any], target: str) -> list[str]:
    out = header(f"time to {target} (s)")
    for s in STRATEGIES:
        cells = []
        for e in EPSILONS:
            v = f"{s}-eps{e}"
            if v not in runs:
                cells.append("not run")
                continue
            st = stats[v][target]["time_s"]
            if not st.get("n"):
                cells.append(f"not reached (0/{st.get('of', len(runs[v]))})")
                continue
            cell = f"{st['mean']:.0f} ± {st.get('std') or 0.0:.0f}"
            cells.append(cell + ("" if st["n"] == st["of"] else f" ({st['n']}/{st['of']} reached)"))
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return out


def paired_table(runs: dict[str, Any]) -> list[str]:
    private = EPSILONS[
        :-1
    ]  # without privacy the runs stop at the target: their last accuracies compare nothing
    out = header("felix minus", private)
    for s in STRATEGIES[1:]:
        cells = []
        for e in private:
            a, b = runs.get(f"felix-eps{e}"), runs.get(f"{s}-eps{e}")
            common = sorted(set(a or {}) & set(b or {}))
            if not common:
                cells.append("-")
                continue
            assert a is not None and b is not None
            d = [a[k]["final_accuracy"] - b[k]["final_accuracy"] for k in common]
            cells.append(f"{statistics.fmean(d):+.3f} [{min(d):+.3f}..{max(d):+.3f}]")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("comparison", help="a comparison.json written by felix compare")
    a = ap.parse_args()
    doc = json.loads(Path(a.comparison).read_text())
    runs, stats = doc["runs"], doc["stats"]
    print("Accuracy of the last evaluation, mean ± sd over seeds (ε: the largest spent):\n")
    print("\n".join(accuracy_table(runs)))
    for target in doc["targets"]:
        key = str(target)
        print(f"\nVirtual seconds to {target} (mean of the last {doc['target_window']} evaluations):\n")
        print("\n".join(time_table(stats, runs, key)))
    print(
        "\nfelix's last-evaluation accuracy minus the strategy's, paired by seed (mean [min..max]), all 127 aggregations:\n"
    )
    print("\n".join(paired_table(runs)))


if __name__ == "__main__":
    main()
