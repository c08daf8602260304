"""``felix federage-compare``: the FedeRage comparison, ``configs/comparisons/federage.yaml``, run
by the one engine.

The file holds the scenario (long-tailed Fashion-MNIST, the rare classes held only by the
rarely-participating clients, ``trace.kind: ram``: sync rounds of one Random Access Model slot,
every drawn client trains, an empty slot leaves the model as it is) and one variant per method
(FedAvg, FedProx, SCAFFOLD, q-FFL, FedeRage at a few alpha / gamma / step rules), each a set of
config overrides. Every run goes through ``felix.sim.run.run_config`` with
``run.per_client_eval``: the final model's per-client measures (``felix.metrics.per_client``).

    felix federage-compare --out runs/federage-compare            # the file's seeds and variants
    felix federage-compare --variants fedavg,scaffold --seeds 0 --set trace.horizon_s=1200

Writes ``federage_compare.md`` (mean ± sample std over seeds, and each method minus the
reference paired by seed), ``federage_compare.json`` (per run, per seed; provenance) and
``client_accuracy.png`` under ``--out``, and every run's folder under ``--out/runs``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from felix.config import ConfigError
from felix.experiments.shipped import COMPARISONS, add_arguments, error_exit, run_from_args
from felix.scenario.datasets import DatasetError

COMMAND = "federage-compare"
METRICS = (
    "mean_client_acc",
    "worst_client_acc",
    "bottom10_acc",
    "rare_client_acc",
    "std_client_acc",
    "global_acc",
    "tail_class_acc",
    "macro_f1",
    "minority_f1",
)
HEADERS = (
    "mean",
    "worst",
    "bottom 10%",
    "rare clients",
    "std",
    "global",
    "tail classes",
    "macro F1",
    "minority F1",
)
DELTA_METRICS = ("mean_client_acc", "bottom10_acc", "rare_client_acc", "tail_class_acc", "global_acc")


def method_runs(results: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per seed, per variant (file order): the per-client measures of the final model, named."""
    seeds = list(dict.fromkeys(r["seed"] for r in results))
    return [
        [
            {
                "method": r["variant"],
                **r["summary"]["per_client"],
                "aggregations": r["summary"]["aggregations"],
                "wall_time_s": r["summary"]["wall_time_s"],
            }
            for r in results
            if r["seed"] == s
        ]
        for s in seeds
    ]


def summarise(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Mean and sample std (ddof 1; 0 for one seed) over seeds of each method's measures, and how
    many seeds ended with a finite model."""
    rows = []
    for per_seed in zip(*runs):
        row: dict[str, Any] = {"method": per_seed[0]["method"]}
        for m in METRICS:
            vals = np.array([s[m] for s in per_seed])
            row[m] = float(vals.mean())
            row[m + "_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        row["finite_seeds"] = sum(bool(s["finite_model"]) for s in per_seed)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], n_seeds: int) -> str:
    def cell(row: dict[str, Any], m: str) -> str:
        return f"{row[m]:.3f}" + (f" ± {row[m + '_std']:.3f}" if n_seeds > 1 else "")

    lines = ["| method | " + " | ".join(HEADERS) + " | finite |", "|" + "---|" * (len(HEADERS) + 2)]
    for row in rows:
        lines.append(
            f"| {row['method']} | "
            + " | ".join(cell(row, m) for m in METRICS)
            + f" | {row['finite_seeds']}/{n_seeds} |"
        )
    return "\n".join(lines) + "\n"


def paired_delta_table(runs: list[list[dict[str, Any]]], reference: str = "fedavg") -> str:
    """Each method minus ``reference`` on the same seed (same data and RAM draws), mean ± sample
    std over seeds, and the seeds where the method is ahead: the scenario changes a lot from seed
    to seed, the paired difference much less."""
    names = [r["method"] for r in runs[0]]
    if reference not in names:
        return ""
    ref = names.index(reference)
    heads = ("mean", "bottom 10%", "rare clients", "tail classes", "global")
    lines = [
        f"| method - {reference} (paired by seed) | " + " | ".join(heads) + " |",
        "|" + "---|" * (len(heads) + 1),
    ]
    for i, name in enumerate(names):
        if i == ref:
            continue
        cells = []
        for m in DELTA_METRICS:
            d = np.array([seed_runs[i][m] - seed_runs[ref][m] for seed_runs in runs])
            std = f" ± {d.std(ddof=1):.3f}" if len(d) > 1 else ""
            cells.append(f"{d.mean():+.3f}{std} ({int((d > 0).sum())}/{len(d)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report_markdown(doc: dict[str, Any]) -> str:
    """The markdown report of a ``federage_compare.json`` document: settings, provenance, tables."""
    prov, runs = doc["provenance"], doc["runs"]
    seeds = doc["settings"]["seeds"]
    git = prov.get("git") or {"commit": "unknown (not a git checkout)", "dirty": False}
    table = markdown_table(doc["summary"], len(seeds))
    deltas = paired_delta_table(runs, doc["reference"] or "fedavg")
    if deltas:
        table += "\nIn parentheses: the seeds on which the method is ahead.\n\n" + deltas
    return (
        "# FedeRage comparison under the Random Access Model\n\n"
        f"Mean ± sample std over seeds {seeds}. Provenance: commit {git['commit'][:12]}"
        f"{' (with local changes)' if git['dirty'] else ''}, torch {prov['torch']}, "
        f"{prov['torch_threads']} torch thread(s).\n\n"
        f"Settings: `{json.dumps(doc['settings'])}`\n\n" + table
    )


def plot_distribution(path: Path, runs: list[list[dict[str, Any]]]) -> None:
    """Box plot of per-client accuracy per method (clients of all seeds pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in runs[0]]
    data = [np.concatenate([seed_runs[i]["client_acc"] for seed_runs in runs]) for i in range(len(names))]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4.5))
    ax.boxplot(data, whis=(5, 95), showmeans=True)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("client accuracy (test set reweighted to client labels)")
    ax.set_title("Accuracy across clients under the Random Access Model")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rounded(value: Any, digits: int = 5) -> Any:
    """Per-run floats to ``digits`` decimals: keeps the committed result JSON small."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    return value


def run(args: argparse.Namespace) -> int:
    """Run the comparison file; write the table, the JSON and the plot under ``--out``."""
    try:
        comp, results, settings = run_from_args(args)
        runs = method_runs(results)
    except (ConfigError, DatasetError, ValueError) as exc:
        return error_exit(COMMAND, exc)
    out = Path(args.out)
    prov = results[0]["summary"]["provenance"]  # the first run's: commit, torch, its threads and run settings
    doc = {
        "comparison": comp.name,
        "reference": comp.reference,
        "settings": settings,
        "provenance": prov,
        "summary": summarise(runs),
        "runs": _rounded(runs),
    }
    report = report_markdown(doc)
    (out / "federage_compare.md").write_text(report)
    (out / "federage_compare.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot_distribution(out / "client_accuracy.png", runs)
    print(report)
    print(
        f"wrote {out / 'federage_compare.md'}, {out / 'federage_compare.json'}, {out / 'client_accuracy.png'}",
        file=sys.stderr,
    )
    return 0


def _configure(p: argparse.ArgumentParser) -> None:
    add_arguments(p, COMPARISONS / "federage.yaml", "runs/federage-compare")
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``felix federage-compare`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        COMMAND,
        help="FedeRage vs FedAvg/FedProx/SCAFFOLD/q-FFL under the RAM (configs/comparisons/federage.yaml)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m felix.experiments.federage",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
