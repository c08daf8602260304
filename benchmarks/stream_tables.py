"""The stream-* tables: per variant of a ``felix compare`` output folder, the mean and spread over
seeds of the time-averaged accuracy on the current class mix, the recovery time after each shift,
the model's mean data age, the final accuracy and the total bytes.

    python benchmarks/stream_tables.py runs/stream-fmnist-abrupt --out docs/results/stream/stream-fmnist-abrupt

Writes ``OUT.json`` (every run's figures and the statistics), ``OUT.md`` (the table) and
``OUT.png`` (each variant's accuracy on the current mix over time, mean over seeds, from the runs'
``evaluations.csv``). A
recovery that did not happen before the next shift or the run's end counts as the time left
(a lower bound), and the table says how many seeds did not recover.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from felix.metrics.freshness import plot_freshness, time_average


def after_first_shift(run_dir: Path, summary: dict[str, Any]) -> float | None:
    """The time average of the accuracy on the current mix from the first shift to the end (the
    step curve of ``evaluations.csv``): how fresh the model stayed once the data moved, without
    the start-up every strategy shares."""
    shifts = summary["stream"]["shifts"]
    if not shifts:
        return None
    start, end = shifts[0]["at_s"], summary["virtual_time_s"]
    with open(run_dir / "evaluations.csv") as f:
        rows = [(float(r["time_s"]), float(r["accuracy"])) for r in csv.DictReader(f)]
    t = np.array([r[0] for r in rows])
    a = np.array([r[1] for r in rows])
    k = int(np.searchsorted(t, start, side="right")) - 1
    times = np.concatenate([[start], t[k + 1 :]])
    values = np.concatenate([[a[k]], a[k + 1 :]])
    return time_average(times, values, end)


def run_figures(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    st = summary["stream"]
    end = summary["virtual_time_s"]
    out: dict[str, Any] = {
        "seed": summary["seed"],
        "time_avg_accuracy": st["time_avg_accuracy"],
        "time_avg_uniform_accuracy": st["time_avg_uniform_accuracy"],
        "time_avg_accuracy_after_shift": after_first_shift(run_dir, summary),
        "final_accuracy": summary["final_accuracy"],
        "data_age_mean_s": st["data_age_mean_s"],
        "total_mb": (summary["bytes_down"] + summary["bytes_up"]) / 1e6,
        "aggregations": summary["aggregations"],
    }
    for i, s in enumerate(st["shifts"]):
        nxt = [x["at_s"] for x in st["shifts"][i + 1 :] if x["at_s"] > s["at_s"]]
        left = min(nxt + [end]) - s["at_s"]
        out[f"recovery_{s['kind']}_s"] = left if s["recovery_s"] is None else s["recovery_s"]
        out[f"recovered_{s['kind']}"] = s["recovery_s"] is not None
    out["shifts"] = st["shifts"]
    return out


def mean_curve(variant_dir: Path, grid_s: float = 60.0) -> dict[str, np.ndarray] | None:
    """The mean over seeds of the runs' accuracy on the current mix (``evaluations.csv``), each run
    held from one evaluation to the next, on a ``grid_s`` grid up to the shortest run's end."""
    per_seed = []
    for path in sorted(variant_dir.glob("seed-*/evaluations.csv")):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        per_seed.append(
            (np.array([float(r["time_s"]) for r in rows]), np.array([float(r["accuracy"]) for r in rows]))
        )
    if not per_seed:
        return None
    end = min(t[-1] for t, _ in per_seed)
    grid = np.arange(0.0, end, grid_s)
    acc = np.mean([a[np.searchsorted(t, grid, side="right") - 1] for t, a in per_seed], axis=0)
    return {"time_s": grid, "accuracy": acc}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a felix compare output folder")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(args.folder.glob("*/seed-*/summary.json")):
        summary = json.loads(path.read_text())
        if "stream" not in summary or summary.get("stop_reason") == "interrupted":
            continue
        runs.setdefault(path.parent.parent.name, []).append(run_figures(summary, path.parent))
    keys = [
        "time_avg_accuracy",
        "time_avg_accuracy_after_shift",
        "time_avg_uniform_accuracy",
        "final_accuracy",
        "data_age_mean_s",
        "total_mb",
    ]
    stats: dict[str, dict[str, Any]] = {}
    for variant, rows in runs.items():
        rec_keys = sorted(k for k in rows[0] if k.startswith("recovery_") and k.endswith("_s"))
        stats[variant] = {"seeds": [r["seed"] for r in rows]}
        for k in keys + rec_keys:
            stats[variant][k] = mean_std([float(r[k]) for r in rows])
        for k in rec_keys:
            kind = k.removeprefix("recovery_").removesuffix("_s")
            stats[variant][f"not_recovered_{kind}"] = sum(not r[f"recovered_{kind}"] for r in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "stats": stats}, indent=1) + "\n")
    rec_cols = sorted({k for s in stats.values() for k in s if k.startswith("recovery_")})
    head = [
        "variant",
        "seeds",
        "time-avg acc (current mix)",
        "from the first shift",
        "time-avg acc (uniform)",
        "final acc",
    ]
    head += [f"recovery {k.removeprefix('recovery_').removesuffix('_s')} (s)" for k in rec_cols]
    head += ["mean data age (s)", "total MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(stats, key=lambda v: -stats[v]["time_avg_accuracy"][0])
    for v in order:
        s = stats[v]
        cells = [v, str(len(s["seeds"]))]
        cells += [
            f"{s[k][0]:.4f} ± {s[k][1]:.4f}"
            for k in (
                "time_avg_accuracy",
                "time_avg_accuracy_after_shift",
                "time_avg_uniform_accuracy",
                "final_accuracy",
            )
        ]
        for k in rec_cols:
            kind = k.removeprefix("recovery_").removesuffix("_s")
            miss = s[f"not_recovered_{kind}"]
            cells.append(f"{s[k][0]:.0f} ± {s[k][1]:.0f}" + (f" ({miss} not)" if miss else ""))
        cells += [
            f"{s['data_age_mean_s'][0]:.0f} ± {s['data_age_mean_s'][1]:.0f}",
            f"{s['total_mb'][0]:.0f} ± {s['total_mb'][1]:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    curves = {v: mean_curve(args.folder / v) for v in order}
    shifts = sorted({s["at_s"] for rows in runs.values() for s in rows[0].get("shifts", [])})
    plot_freshness(args.out.with_suffix(".png"), {v: c for v, c in curves.items() if c is not None}, shifts)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
