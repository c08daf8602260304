"""The secagg-* tables of docs/privacy.md from a ``felix compare`` output folder: per variant, time
and bytes to each target (mean ± sd over seeds, from each run's ``evaluations.csv`` under the
comparison's target rule), the secure-aggregation counts from each run's ``summary.json`` (groups
and abandoned ones, updates lost, dropouts recovered and deadlines, summed over seeds; the delay
and the protocol's bytes, per run), and each ``X+secagg`` paired by seed with ``X``: time to each
target with secure aggregation over without.

    python benchmarks/secagg_tables.py runs/secagg-90 > secagg-90.md

A variant's runs are read from its folder as ``felix compare`` names it (``oort-async*+secagg`` in
``oort-async-oracle-secagg``); a run that did not reach a target counts in ``n/m reached``."""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

from felix.metrics.recorder import reached_target


def _at_targets(csv_path: Path, targets: list[float], window: int) -> dict[float, tuple[float, int] | None]:
    """(time, bytes) at which each target is first met under the comparison's rule, or None."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    accs: list[float] = []
    out: dict[float, tuple[float, int] | None] = dict.fromkeys(targets)
    for r in rows:
        accs.append(float(r["accuracy"]))
        for t in targets:
            if out[t] is None and reached_target(accs, t, window):
                out[t] = (float(r["time_s"]), int(r["bytes_total"]))
    return out


def _spread(values: list[float], of: int, digits: int = 0) -> str:
    if not values:
        return f"not reached (0/{of})"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    text = f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"
    return text if len(values) == of else f"{text} ({len(values)}/{of} reached)"


def tables(folder: Path) -> str:
    doc = json.loads((folder / "comparison.json").read_text())
    targets = [float(t) for t in doc["targets"]]
    window = int(doc["target_window"])
    seeds = [int(s) for s in doc["seeds"]]
    per: dict[str, dict[int, dict[str, Any]]] = {
        variant: {int(seed): summary for seed, summary in runs.items()}
        for variant, runs in doc["runs"].items()
    }
    dirs = _run_dirs(folder, doc)
    head = ["strategy"]
    for t in targets:
        head += [f"time to {t:g} (s)", f"MB to {t:g}"]
    head += [
        "groups (abandoned)",
        "updates lost",
        "dropouts recovered",
        "deadlines",
        "delay per run (s)",
        "protocol MB per run",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reached: dict[str, dict[int, dict[float, tuple[float, int] | None]]] = {}
    for variant in doc["runs"]:
        reached[variant] = {
            s: _at_targets(dirs[variant][s] / "evaluations.csv", targets, window) for s in seeds
        }
        cells = [variant.replace("*", "\\*")]
        for t in targets:
            hits = [reached[variant][s][t] for s in seeds]
            cells.append(_spread([h[0] for h in hits if h is not None], len(seeds)))
            cells.append(_spread([h[1] / 1e6 for h in hits if h is not None], len(seeds)))
        sa = [per[variant][s].get("secure_aggregation") for s in seeds]
        if all(x is not None for x in sa):
            cells += [
                f"{sum(x['groups'] for x in sa)} ({sum(x['groups_abandoned'] for x in sa)})",
                _spread([float(x["updates_lost"]) for x in sa], len(seeds), 1),
                str(sum(x["dropouts_recovered"] for x in sa)),
                str(sum(x["deadlines"] for x in sa)),
                _spread([float(x["delay_s"]) for x in sa], len(seeds)),
                _spread([x["bytes_overhead"] / 1e6 for x in sa], len(seeds), 1),
            ]
        else:
            cells += ["-"] * 6
        lines.append("| " + " | ".join(cells) + " |")
    ratio_head = ["orchestration"] + [f"time to {t:g}, with / without" for t in targets]
    ratio = ["| " + " | ".join(ratio_head) + " |", "|" + "---|" * len(ratio_head)]
    for variant in doc["runs"]:
        if not variant.endswith("+secagg") or variant.removesuffix("+secagg") not in reached:
            continue
        base = variant.removesuffix("+secagg")
        cells = [base.replace("*", "\\*")]
        for t in targets:
            pairs = [
                (reached[variant][s][t], reached[base][s][t])
                for s in seeds
                if reached[variant][s][t] is not None and reached[base][s][t] is not None
            ]
            cells.append(_spread([w[0] / p[0] for w, p in pairs], len(seeds), 2))
        ratio.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nPaired by seed:\n\n" + "\n".join(ratio) + "\n"


def _run_dirs(folder: Path, doc: dict[str, Any]) -> dict[str, dict[int, Path]]:
    """Each variant's run folders: ``<folder>/<variant folder>/seed-<n>``, the variant folder named
    as ``felix compare`` names it (``*`` written ``-oracle``, ``+`` written ``-``)."""
    out: dict[str, dict[int, Path]] = {}
    for variant in doc["runs"]:
        name = variant.replace("*", "-oracle").replace("+", "-")
        out[variant] = {int(s): folder / name / f"seed-{s}" for s in doc["seeds"]}
        for p in out[variant].values():
            if not (p / "evaluations.csv").is_file():
                raise SystemExit(f"{p}: no evaluations.csv (is {folder} a felix compare output folder?)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a felix compare output folder of a secagg-* comparison")
    args = ap.parse_args()
    print(tables(args.folder), end="")


if __name__ == "__main__":
    main()
