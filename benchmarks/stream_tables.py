"""The stream-* tables: per variant of a ``felix compare`` output folder, the mean and spread over
seeds of the time-averaged accuracy on the current class mix (over the run, from the first shift,
and over each stretch between shifts), the recovery time after each shift, the model's mean data
age, the updates' staleness, the final accuracy and the total bytes; and each variant paired by
seed with the reference (the same clients, data and stream for every variant of a seed).

    python benchmarks/stream_tables.py runs/stream-fmnist-abrupt --out docs/results/stream/stream-fmnist-abrupt
    python benchmarks/stream_tables.py --overview docs/results/stream/stream-fmnist-*.json --out docs/results/stream/overview
    python benchmarks/stream_tables.py --between docs/results/stream/stream-fmnist-abrupt{,-nodelay}.json \
        --out docs/results/stream/delay-abrupt

Writes ``OUT.json`` (every run's figures, the statistics and the contrasts), ``OUT.md`` (the tables) and
``OUT.png`` (each variant's accuracy on the current mix over time, mean over seeds, from the runs'
``evaluations.csv``). A recovery that did not happen before the next shift or the run's end counts
as the time left (a lower bound), and the table says how many seeds did not recover. With
``--overview``, the ``OUT.json`` files of several comparisons become one table: each variant's
time-averaged accuracy and its paired difference to the reference, one column per comparison.
With ``--between``, two comparisons that differ in one setting (the label delay) become one table:
each variant's first-minus-second differences, paired by seed.
The contrasts are the pairs of variants that differ in one part of the orchestration
(``CONTRASTS``: TierFuse, TierTrack knowledge with TierSelect probes, an availability oracle, the
data-age option, asynchrony), each paired by seed, where both ran.
Variants are named as in the comparison file (``oort-async*``), read from the folder's
``manifest.json``; without one, by their folder (``oort-async-oracle``).
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


def step_curve(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The run's accuracy on the current mix at each evaluation (``evaluations.csv``)."""
    with open(run_dir / "evaluations.csv") as f:
        rows = [(float(r["time_s"]), float(r["accuracy"])) for r in csv.DictReader(f)]
    return np.array([r[0] for r in rows]), np.array([r[1] for r in rows])


def window_average(t: np.ndarray, a: np.ndarray, start: float, end: float) -> float | None:
    """The time average over [start, end] of the step curve (each evaluation held until the next)."""
    k = int(np.searchsorted(t, start, side="right")) - 1
    if k < 0 or end <= start:
        return None
    inside = (t > start) & (t < end)
    times = np.concatenate([[start], t[inside]])
    values = np.concatenate([[a[k]], a[inside]])
    return time_average(times, values, end)


def run_figures(summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One run's figures: the summary's stream section, the step curve's averages from the first
    shift and over each stretch from a shift to the next (how well the model served the mix while
    it held), the diagnostics that explain freshness (staleness, tasks lost), bytes."""
    st = summary["stream"]
    end = summary["virtual_time_s"]
    diag = summary.get("diagnostics", {})
    t, a = step_curve(run_dir)
    shifts = st["shifts"]
    out: dict[str, Any] = {
        "seed": summary["seed"],
        "time_avg_accuracy": st["time_avg_accuracy"],
        "time_avg_uniform_accuracy": st["time_avg_uniform_accuracy"],
        "time_avg_accuracy_after_shift": window_average(t, a, shifts[0]["at_s"], end) if shifts else None,
        "final_accuracy": summary["final_accuracy"],
        "data_age_mean_s": st["data_age_mean_s"],
        "staleness_mean": diag.get("staleness_mean"),
        "dropped_share": diag.get("dropped_share"),
        "total_mb": (summary["bytes_down"] + summary["bytes_up"]) / 1e6,
        "aggregations": summary["aggregations"],
    }
    for i, s in enumerate(shifts):
        nxt = [x["at_s"] for x in shifts[i + 1 :] if x["at_s"] > s["at_s"]]
        until = min(nxt + [end])
        out[f"recovery_{s['kind']}_s"] = until - s["at_s"] if s["recovery_s"] is None else s["recovery_s"]
        out[f"recovered_{s['kind']}"] = s["recovery_s"] is not None
        out[f"acc_during_{s['kind']}"] = window_average(t, a, s["at_s"], until)
    out["shifts"] = shifts
    return out


def mean_curve(variant_dir: Path, grid_s: float = 60.0) -> dict[str, np.ndarray] | None:
    """The mean over seeds of the runs' accuracy on the current mix (``evaluations.csv``), each run
    held from one evaluation to the next, on a ``grid_s`` grid up to the shortest run's end."""
    per_seed = [step_curve(p.parent) for p in sorted(variant_dir.glob("seed-*/evaluations.csv"))]
    if not per_seed:
        return None
    end = min(t[-1] for t, _ in per_seed)
    grid = np.arange(0.0, end, grid_s)
    acc = np.mean([a[np.searchsorted(t, grid, side="right") - 1] for t, a in per_seed], axis=0)
    return {"time_s": grid, "accuracy": acc}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def read_manifest(folder: Path) -> dict[str, Any]:
    """The compare folder's ``manifest.json`` ({} without one)."""
    manifest = folder / "manifest.json"
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def variant_names(manifest: dict[str, Any]) -> dict[str, str]:
    """Folder name -> variant name (``oort-async-oracle`` -> ``oort-async*``) from the manifest."""
    runs = manifest.get("runs", {})
    return {
        r["folder"].split("/")[0]: r["variant"] for r in runs.values() if "folder" in r and "variant" in r
    }


STAT_KEYS = [
    "time_avg_accuracy",
    "time_avg_accuracy_after_shift",
    "time_avg_uniform_accuracy",
    "final_accuracy",
    "data_age_mean_s",
    "staleness_mean",
    "dropped_share",
    "total_mb",
    "aggregations",
]
SHIFT_ORDER = ("rotate", "surge", "surge_end")
# Pairs of variants that differ in one part of the orchestration (the presets' settings otherwise
# equal), so that their paired difference is that part's effect: (variant, against, what differs).
CONTRASTS = [
    ("felix", "felix-no-tierfuse", "TierFuse in place of FedBuff's weights (all else FeLiX)"),
    (
        "felix-no-tierfuse",
        "oort-async",
        "TierTrack knowledge and TierSelect probes (both FedBuff weights, Oort)",
    ),
    ("oort-async*", "oort-async", "an availability oracle (both FedBuff weights, Oort, no probes)"),
    ("felix-fresh", "felix", "TierFuse's data-age option"),
    ("oort-async*", "oort*", "an async buffer against sync rounds (both Oort with the oracle)"),
    ("fedbuff", "fedavg", "an async buffer against sync rounds (both random, no knowledge)"),
]
PAIRED_KEYS = ["time_avg_accuracy", "time_avg_accuracy_after_shift", "data_age_mean_s", "total_mb"]


def paired(rows: list[dict[str, Any]], ref_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Figures of ``rows`` against ``ref_rows`` on the seeds both ran: differences (bytes: ratios),
    their mean and spread, and on how many seeds the first is higher."""
    ref = {r["seed"]: r for r in ref_rows}
    out: dict[str, dict[str, Any]] = {}
    for k in PAIRED_KEYS:
        pairs = [
            (float(r[k]), float(ref[r["seed"]][k]))
            for r in rows
            if r["seed"] in ref and r.get(k) is not None and ref[r["seed"]].get(k) is not None
        ]
        if not pairs:
            continue
        diffs = [v / w for v, w in pairs] if k == "total_mb" else [v - w for v, w in pairs]
        out[k] = {
            "mean": statistics.fmean(diffs),
            "std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "higher": sum(v > w for v, w in pairs),
            "seeds": len(pairs),
        }
    return out


def statistics_of(runs: dict[str, list[dict[str, Any]]], reference: str) -> dict[str, dict[str, Any]]:
    """Mean and spread over seeds of every figure, and each variant's difference to the reference
    on the seeds both ran (``paired_<key>``: mean, spread, seeds where the variant is higher)."""
    stats: dict[str, dict[str, Any]] = {}
    for variant, rows in runs.items():
        per_shift = sorted(k for k in rows[0] if k.startswith(("recovery_", "acc_during_")))
        s: dict[str, Any] = {"seeds": [r["seed"] for r in rows]}
        for k in STAT_KEYS + per_shift:
            vals = [float(r[k]) for r in rows if r.get(k) is not None]
            if vals:
                s[k] = mean_std(vals)
        for k in per_shift:
            if k.startswith("recovery_"):
                kind = k.removeprefix("recovery_").removesuffix("_s")
                s[f"not_recovered_{kind}"] = sum(not r[f"recovered_{kind}"] for r in rows)
        if variant != reference and reference in runs:
            for k, p in paired(rows, runs[reference]).items():
                s[f"paired_{k}"] = p
        stats[variant] = s
    return stats


def contrasts_of(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ``CONTRASTS`` whose two variants both ran, each paired by seed."""
    out = []
    for a, b, what in CONTRASTS:
        if a in runs and b in runs:
            p = paired(runs[a], runs[b])
            if p:
                out.append({"variant": a, "against": b, "isolates": what, "paired": p})
    return out


def _pm(s: dict[str, Any], key: str, fmt: str) -> str:
    if key not in s:
        return "-"
    m, sd = s[key]
    return f"{m:{fmt}} ± {sd:{fmt}}"


def tables(stats: dict[str, dict[str, Any]], reference: str) -> list[str]:
    """The markdown of the main table (ordered by time-averaged accuracy) and the paired one."""
    found = {
        k.removeprefix("recovery_").removesuffix("_s")
        for s in stats.values()
        for k in s
        if k.startswith("recovery_")
    }
    kinds = [k for k in SHIFT_ORDER if k in found] + sorted(found - set(SHIFT_ORDER))
    head = ["variant", "seeds", "time-avg acc (current mix)", "from the first shift"]
    head += [f"from {k} to next" for k in kinds] if len(kinds) > 1 else []
    head += ["time-avg acc (uniform)", "final acc"]
    head += [f"recovery {k} (s)" for k in kinds]
    head += ["mean data age (s)", "staleness (versions)", "total MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(stats, key=lambda v: -stats[v]["time_avg_accuracy"][0])
    for v in order:
        s = stats[v]
        cells = [
            v,
            str(len(s["seeds"])),
            _pm(s, "time_avg_accuracy", ".4f"),
            _pm(s, "time_avg_accuracy_after_shift", ".4f"),
        ]
        cells += [_pm(s, f"acc_during_{k}", ".4f") for k in kinds] if len(kinds) > 1 else []
        cells += [_pm(s, "time_avg_uniform_accuracy", ".4f"), _pm(s, "final_accuracy", ".4f")]
        for k in kinds:
            miss = s.get(f"not_recovered_{k}", 0)
            cells.append(_pm(s, f"recovery_{k}_s", ".0f") + (f" ({miss} not)" if miss else ""))
        cells += [
            _pm(s, "data_age_mean_s", ".0f"),
            _pm(s, "staleness_mean", ".1f"),
            _pm(s, "total_mb", ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        (
            f"Paired by seed with `{reference}` (variant minus {reference}, mean ± std over the seeds both ran; "
            "in brackets the seeds on which the variant is higher; bytes as a ratio):"
        ),
        "",
        "| variant | seeds | Δ time-avg acc | Δ from the first shift | Δ data age (s) | bytes / reference |",
        "|---|---|---|---|---|---|",
    ]
    for v in order:
        s = stats[v]
        if "paired_time_avg_accuracy" not in s:
            continue
        cells = [v, str(s["paired_time_avg_accuracy"]["seeds"])]
        cells += _paired_cells({k: s[f"paired_{k}"] for k in PAIRED_KEYS if f"paired_{k}" in s})
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _paired_cells(p: dict[str, dict[str, Any]]) -> list[str]:
    """The cells of one paired comparison (:func:`paired`): the differences of the time-averaged
    accuracy, over the run and from the first shift, and of the data age, each with the seeds on
    which the first is higher; the bytes as a ratio."""
    cells = []
    for k, fmt in (
        ("time_avg_accuracy", "+.4f"),
        ("time_avg_accuracy_after_shift", "+.4f"),
        ("data_age_mean_s", "+.0f"),
    ):
        q = p.get(k)
        cells.append(
            "-" if q is None else f"{q['mean']:{fmt}} ± {q['std']:.{fmt[-2]}f} ({q['higher']}/{q['seeds']})"
        )
    q = p.get("total_mb")
    cells.append("-" if q is None else f"{q['mean']:.2f} ± {q['std']:.2f}")
    return cells


def contrast_table(contrasts: list[dict[str, Any]]) -> list[str]:
    """The markdown of the contrasts: each pair's paired difference, what the pair isolates."""
    if not contrasts:
        return []
    lines = [
        "",
        (
            "Contrasts (the first variant minus the second, paired by seed; in brackets the seeds on which the "
            "first is higher; bytes as a ratio):"
        ),
        "",
        "| contrast | isolates | seeds | Δ time-avg acc | Δ from the first shift | Δ data age (s) | bytes ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in contrasts:
        p = c["paired"]
        cells = [f"{c['variant']} − {c['against']}", c["isolates"], str(p["time_avg_accuracy"]["seeds"])]
        lines.append("| " + " | ".join(cells + _paired_cells(p)) + " |")
    return lines


def overview(paths: list[Path], out: Path) -> list[str]:
    """One row per variant, one column per comparison: time-averaged accuracy (mean ± std) and, in
    brackets, its paired difference to the comparison's reference."""
    docs = {p.stem: json.loads(p.read_text()) for p in paths}
    variants: list[str] = []
    for d in docs.values():
        order = sorted(d["stats"], key=lambda v: -d["stats"][v]["time_avg_accuracy"][0])
        variants += [v for v in order if v not in variants]
    lines = [
        "| variant | " + " | ".join(f"`{n}`" for n in docs) + " |",
        "|---|" + "---|" * len(docs),
    ]
    for v in variants:
        cells = [v]
        for d in docs.values():
            s = d["stats"].get(v)
            if s is None:
                cells.append("not run")
                continue
            cell = f"{s['time_avg_accuracy'][0]:.4f} ± {s['time_avg_accuracy'][1]:.4f}"
            if len(s["seeds"]) < 3:
                cell += f" ({len(s['seeds'])} seeds)"
            p = s.get("paired_time_avg_accuracy")
            if p is not None:
                cell += f" ({p['mean']:+.4f}, {p['higher']}/{p['seeds']})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return lines


def between(first: Path, second: Path, out: Path) -> list[str]:
    """Each variant of two comparisons that differ in one setting (the label delay: a file and its
    ``-nodelay`` twin) on the same seeds: the first's figures minus the second's, paired by seed.
    A pair made on CPUs of different vendors carries their float noise as well (said above the table)."""
    docs = [json.loads(p.read_text()) for p in (first, second)]
    names = [d.get("comparison") or p.stem for d, p in zip(docs, (first, second), strict=True)]
    cpus = [(d.get("provenance") or {}).get("cpu") for d in docs]
    lines = [
        f"`{names[0]}` minus `{names[1]}`, each variant paired by seed (mean ± std over the seeds both ran; in "
        "brackets the seeds on which the first is higher; bytes as a ratio)"
        + (
            "."
            if cpus[0] == cpus[1]
            else f"; made on different CPUs ({cpus[0]}, {cpus[1]}): vendor noise included."
        ),
        "",
        "| variant | seeds | Δ time-avg acc | Δ from the first shift | Δ data age (s) | bytes ratio |",
        "|---|---|---|---|---|---|",
    ]
    runs = [d["runs"] for d in docs]
    for v in sorted(runs[0], key=lambda v: -docs[0]["stats"][v]["time_avg_accuracy"][0]):
        if v not in runs[1]:
            continue
        p = paired(runs[0][v], runs[1][v])
        if "time_avg_accuracy" in p:
            lines.append(
                "| " + " | ".join([v, str(p["time_avg_accuracy"]["seeds"]), *_paired_cells(p)]) + " |"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("folder", type=Path, nargs="?", help="a felix compare output folder")
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--reference", default="felix", help="the variant the paired differences are to")
    ap.add_argument(
        "--overview", type=Path, nargs="+", help="OUT.json files of several comparisons: one table"
    )
    ap.add_argument(
        "--between",
        type=Path,
        nargs=2,
        metavar=("FIRST", "SECOND"),
        help="OUT.json files of two comparisons on the same seeds: FIRST minus SECOND per variant",
    )
    args = ap.parse_args()
    if args.between:
        print("\n".join(between(*args.between, args.out)))
        return
    if args.overview:
        print("\n".join(overview(args.overview, args.out)))
        return
    if args.folder is None:
        ap.error("give a compare output folder or --overview")
    manifest = read_manifest(args.folder)
    names = variant_names(manifest)
    runs: dict[str, list[dict[str, Any]]] = {}
    dirs: dict[str, Path] = {}
    for path in sorted(args.folder.glob("*/seed-*/summary.json")):
        summary = json.loads(path.read_text())
        if "stream" not in summary or summary.get("stop_reason") == "interrupted":
            continue
        name = names.get(path.parent.parent.name, path.parent.parent.name)
        dirs[name] = path.parent.parent
        runs.setdefault(name, []).append(run_figures(summary, path.parent))
    stats = statistics_of(runs, args.reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    contrasts = contrasts_of(runs)
    doc = {
        "comparison": manifest.get("comparison", {}).get("name"),
        "command": manifest.get("command"),
        "provenance": manifest.get("provenance"),
        "reference": args.reference,
        "runs": runs,
        "stats": stats,
        "contrasts": contrasts,
    }
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = tables(stats, args.reference) + contrast_table(contrasts)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    order = sorted(stats, key=lambda v: -stats[v]["time_avg_accuracy"][0])
    curves = {v: mean_curve(dirs[v]) for v in order}
    shifts = sorted({s["at_s"] for rows in runs.values() for s in rows[0].get("shifts", [])})
    plot_freshness(args.out.with_suffix(".png"), {v: c for v, c in curves.items() if c is not None}, shifts)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
