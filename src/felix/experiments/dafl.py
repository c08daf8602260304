"""``felix dafl-experiment``: the DAFL paper's Table IV, ``configs/comparisons/dafl-table4.yaml``,
run by the one engine.

Eight clients hold the client x class counts of a Table II partition of the first eight CIFAR-10
classes (the file ships D2 scaled by 0.1; ``--case`` / ``--scale`` replace the table by another
case or scale, ``scale_table``). Every variant trains with full-participation synchronous FedAvg,
differing only in what the paper varies: NIC (plain cross-entropy), WCEL (``wce``), LB
(``data_plan: lb``), FedProx, focal loss and DAFL (``data_plan: dafl``). Time is virtual (runtime
``per_sample``: a round lasts as long as its largest client, augmentation included). A run stops
by the paper's convergence rule (``run.converge_threshold`` / ``converge_patience``: training-loss
change below the threshold for that many consecutive rounds) or at ``run.max_aggregations``; its
final model is measured on the balanced test set (``run.per_client_eval``: accuracy, macro F1
and the minority-class F1).

    felix dafl-experiment --out runs/dafl-table4
    felix dafl-experiment --case D3 --scale 0.05 --variants NIC,DAFL --seeds 0

Writes ``dafl_table.md`` (Table IV's layout, mean ± std over seeds) and ``dafl_results.json``
under ``--out``, and every run's folder under ``--out/runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from felix.config import ConfigError
from felix.experiments.shipped import COMPARISONS, add_arguments, error_exit, run_from_args
from felix.scenario.datasets import DatasetError
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition

__all__ = ["add_parser", "main", "run", "scale_table"]

COMMAND: Final = "dafl-experiment"


def scale_table(table: NDArray[np.int64], scale: float) -> NDArray[np.int64]:
    """``table * scale`` rounded half up, at least 1 wherever ``table`` is positive, so a scaled
    partition keeps every client-class pair the paper has (and every class present)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"--scale must be a finite number > 0, got {scale!r}")
    t = np.asarray(table, dtype=np.int64)
    scaled = np.floor(t * scale + 0.5).astype(np.int64)
    return np.where(t > 0, np.maximum(scaled, 1), 0)


def case_override(case: str, scale: float) -> str:
    """``--case`` / ``--scale`` as a ``--set`` item replacing the file's partition table."""
    if case.upper() not in DATASET_NAMES:
        raise ValueError(f"unknown partition {case!r}; expected one of {', '.join(DATASET_NAMES)}")
    return f"partition.table={scale_table(partition(case.upper()), scale).tolist()}"


def result_row(r: dict[str, Any]) -> dict[str, Any]:
    """One run's Table IV measures from its summary."""
    s, conv = r["summary"], r["summary"].get("convergence") or {}
    pc, plan, aug = s["per_client"], s.get("data_plan") or {}, s.get("augmentation") or {}
    return {
        "method": r["variant"],
        "seed": r["seed"],
        "converged": conv.get("round") is not None,
        "rounds": conv.get("round"),
        "time_s": conv.get("time_s"),
        "minority_f1": pc["minority_f1"],
        "accuracy": pc["global_acc"],
        "macro_f1": pc["macro_f1"],
        "per_class_f1": pc["per_class_f1"],
        "minority_classes": pc["minority_classes"],
        "added": plan.get("added", 0),
        "augmentation_s": aug.get("max_virtual_s", 0.0),
        "virtual_time_s": s["virtual_time_s"],
        "wall_time_s": s["wall_time_s"],
        "aggregations": s["aggregations"],
        "stop_reason": s["stop_reason"],
    }


ROWS: Final = (
    ("Rounds", "rounds", 1),
    ("Time (s)", "time_s", 1),
    ("Minority F1", "minority_f1", 3),
    ("Accuracy", "accuracy", 3),
    ("Macro F1", "macro_f1", 3),
    ("Added samples", "added", 0),
    ("Aug. time (s)", "augmentation_s", 2),
    ("Run time (s)", "virtual_time_s", 1),
)
#: Rows that describe the whole run, not the model it ended with.
_RUN_KEYS: Final = ("added", "augmentation_s", "virtual_time_s")


def _cell(runs: list[dict[str, Any]], key: str, digits: int, rounds: int | None) -> str:
    """mean ± std over seeds. Convergence cells average the converged seeds and say how many
    converged; metric cells of a seed that did not converge come from its last model (``*``)."""
    if key in ("rounds", "time_s"):
        vals = [r[key] for r in runs if r["converged"]]
        if not vals:
            return f"n/c (>{rounds})" if rounds else "n/c"
        note = "" if len(vals) == len(runs) else f" ({len(vals)}/{len(runs)} conv.)"
    else:
        vals = [r[key] for r in runs]
        note = "" if all(r["converged"] for r in runs) or key in _RUN_KEYS else "*"
    arr = np.asarray(vals, dtype=np.float64)
    text = f"{arr.mean():.{digits}f}"
    if len(runs) > 1:
        text += f" ± {arr.std():.{digits}f}"
    return text + note


def markdown_table(rows: list[dict[str, Any]], methods: Sequence[str], case: str, rounds: int | None) -> str:
    """Table IV's layout: a row per metric and method."""
    lines = [f"| Metric | Method | {case} |", "|---|---|---|"]
    for title, key, digits in ROWS:
        for i, m in enumerate(methods):
            runs = [r for r in rows if r["method"] == m]
            lines.append(f"| {title if i == 0 else ''} | {m} | {_cell(runs, key, digits, rounds)} |")
    return "\n".join(lines) + "\n"


def summarise(rows: list[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """Per method: mean and std of every table measure over the seeds (None when no value)."""
    out = []
    for m in methods:
        runs = [r for r in rows if r["method"] == m]
        row: dict[str, Any] = {
            "method": m,
            "seeds": len(runs),
            "converged": sum(r["converged"] for r in runs),
        }
        for _, key, _ in ROWS:
            vals = [r[key] for r in runs if r[key] is not None]
            row[key] = float(np.mean(vals)) if vals else None
            row[key + "_std"] = float(np.std(vals)) if vals else None
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the comparison file; write ``dafl_table.md`` and ``dafl_results.json`` under ``--out``
    and print the table; bad input is one line on stderr and exit 2."""
    try:
        if args.case is not None:
            args.set = [case_override(args.case, args.scale), *args.set]
        elif args.scale != 1.0:
            raise ValueError("--scale applies to --case (the file's table is already scaled)")
        comp, results, settings = run_from_args(args)
    except (ConfigError, DatasetError, ValueError) as exc:
        return error_exit(COMMAND, exc)
    rows = [result_row(r) for r in results]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    c = results[0]["summary"]["provenance"].get("run") or {}  # the run section, the same for every run
    rounds = c.get("max_aggregations")
    case = args.case.upper() if args.case else comp.name
    table = markdown_table(rows, methods, case, rounds)
    note = (
        f"\nConvergence: training-loss change < {c.get('converge_threshold')} for {c.get('converge_patience')} "
        "consecutive rounds; a run stops there. Metrics are of the final model; `*`: some seeds did not "
        f"converge within {rounds} rounds and use their last model. Time is virtual and includes "
        "augmentation; 'Run time' is the virtual time of the whole run.\n"
    )
    out = Path(args.out)
    header = f"# DAFL experiment: {case} (seeds {' '.join(map(str, settings['seeds']))})\n\n"
    (out / "dafl_table.md").write_text(header + table + note)
    (out / "dafl_results.json").write_text(
        json.dumps(
            {
                "comparison": comp.name,
                "settings": settings,
                "provenance": results[0]["summary"]["provenance"],
                "summary": summarise(rows, methods),
                "runs": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(table + note)
    return 0


def _configure(p: argparse.ArgumentParser) -> None:
    add_arguments(p, COMPARISONS / "dafl-table4.yaml", "runs/dafl-experiment")
    p.add_argument("--case", default=None, help="replace the file's table by this Table II partition (D1-D6)")
    p.add_argument(
        "--scale", type=float, default=1.0, help="with --case: multiply its counts (default: %(default)s)"
    )
    p.set_defaults(func=run)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``felix dafl-experiment`` on the CLI's subparsers; dispatch via ``args.func``."""
    p = subparsers.add_parser(
        COMMAND,
        help="the DAFL paper's Table IV (configs/comparisons/dafl-table4.yaml)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m felix.experiments.dafl``)."""
    p = argparse.ArgumentParser(
        prog="python -m felix.experiments.dafl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
