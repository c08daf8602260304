"""A run's outputs: summary.json, the per-evaluation table (CSV) and the two PNG plots."""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from felix.config import ConfigError
from felix.core.refusals import Refusal, count_kind
from felix.core.stats import OrchestratorStats
from felix.metrics.provenance import provenance
from felix.metrics.recorder import EvalRow, Recorder

#: evaluations.csv's columns; a run with privacy on adds ``epsilon`` (the budget spent by then).
EVAL_COLUMNS = [f for f in EvalRow.__dataclass_fields__ if f != "epsilon"]
#: The percentiles of the recorded update weights a run's diagnostics keep
#: (``agg_weight_percentiles``): their distribution to 1%, enough for the share of updates above
#: any weight (the FeLiX paper's Fig. 15 argument) without keeping every weight.
WEIGHT_PERCENTILES = np.arange(101)
REASON_KEYS_MAX = 64  # distinct rejection reasons counted; the rest go under "other"


def reason_key(reason: str) -> str:
    """A stable counter key for a rejection reason: numbers (task ids, shapes, norms) become N."""
    return re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", "N", reason)


def tally_rejection(counts: dict[str, int], reason: str) -> None:
    """Count ``reason`` in ``counts`` under its key. Past ``REASON_KEYS_MAX`` distinct keys a new
    one counts as ``other``: a reason may quote what a client sent, and no client may grow the
    server's memory with it."""
    key = reason_key(reason)
    if key not in counts and len(counts) >= REASON_KEYS_MAX:
        key = "other"
    counts[key] = counts.get(key, 0) + 1


def rejections_by_reason(reasons: Iterable[str]) -> dict[str, int]:
    """The summary's ``rejected_by_reason``: each reason's count, sorted by key."""
    counts: dict[str, int] = {}
    for reason in reasons:
        tally_rejection(counts, reason)
    return dict(sorted(counts.items()))


def rejections_by_kind(kinds: Iterable[Refusal]) -> dict[str, int]:
    """The summary's ``rejected_by_kind``: each kind's count (:class:`Refusal`), sorted by kind."""
    counts: dict[str, int] = {}
    for kind in kinds:
        count_kind(counts, kind)
    return dict(sorted(counts.items()))


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def diagnostics(stats: OrchestratorStats) -> dict[str, Any]:
    """FeLiX §6.3's diagnostics: time between aggregations, staleness (versions behind, per applied
    update), utility age at selection (rounds since the picked client's utility was measured), the
    utility and compute time of the clients picked to train as the orchestrator knew them at the pick
    (Fig. 13 / 14), weight spread, dropped work. The run controller adds the aggregator's stall time
    (``felix.metrics.stall``)."""
    times = np.asarray(stats.aggregation_times)
    intervals = np.diff(np.concatenate([[0.0], times])) if len(times) else np.array([])
    w = np.asarray(stats.agg_weights)
    return {
        "aggregation_interval_p50_s": _pct(intervals, 50),
        "aggregation_interval_p95_s": _pct(intervals, 95),
        "aggregation_interval_max_s": float(intervals.max()) if len(intervals) else None,
        "staleness_mean": float(np.mean(stats.staleness)) if stats.staleness else None,
        "staleness_p50": _pct(stats.staleness, 50),
        "staleness_p95": _pct(stats.staleness, 95),
        "staleness_max": int(max(stats.staleness)) if stats.staleness else None,
        "utility_age_at_selection_mean": float(np.mean(stats.utility_age_at_selection))
        if stats.utility_age_at_selection
        else None,
        "utility_age_at_selection_p50": _pct(stats.utility_age_at_selection, 50),
        "utility_age_at_selection_p95": _pct(stats.utility_age_at_selection, 95),
        "selections_never_explored": stats.never_explored_at_selection,
        "selected_utility_p50": _pct(stats.selected_utility, 50),
        "selected_utility_mean": float(np.mean(stats.selected_utility)) if stats.selected_utility else None,
        "selected_compute_s_p50": _pct(stats.selected_compute_s, 50),
        "selected_compute_s_mean": float(np.mean(stats.selected_compute_s))
        if stats.selected_compute_s
        else None,
        "selections_never_trained": stats.never_trained_at_selection,
        "agg_weight_p5": _pct(w, 5),
        "agg_weight_p50": _pct(w, 50),
        "agg_weight_p95": _pct(w, 95),
        "agg_weight_cv": float(w.std() / w.mean()) if len(w) and w.mean() else None,
        "agg_weight_percentiles": np.percentile(w, WEIGHT_PERCENTILES).tolist() if len(w) else None,
        "train_dispatched": stats.train_dispatched,
        "train_dropped_mid_task": stats.train_dropped,
        "train_cancelled": stats.train_cancelled,
        "dropped_share": stats.train_dropped / stats.train_dispatched if stats.train_dispatched else 0.0,
        "eval_dispatched": stats.eval_dispatched,
        "evals_done": stats.evals_done,
        "rounds_started": stats.rounds_started,
        "rejected": stats.rejected,
        "updates_clipped": stats.updates_clipped,
    }


def summary(
    strategy: str,
    seed: int,
    rec: Recorder,
    stats: OrchestratorStats,
    version: int,
    virtual_time_s: float,
    wall_time_s: float,
    stop_reason: str,
    extra: dict[str, Any] | None = None,
    run_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's headline figures, diagnostics and provenance (commit, torch, threads, device)."""
    b = rec.bytes
    accs = [r.accuracy for r in rec.rows]
    out: dict[str, Any] = {
        "strategy": strategy,
        "seed": seed,
        "target_accuracy": rec.target,
        "target_window": rec.window,
        "time_to_target_s": rec.time_to_target,
        "bytes_to_target": rec.bytes_to_target,
        "version_at_target": rec.version_at_target,
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "virtual_time_s": virtual_time_s,
        "wall_time_s": wall_time_s,
        "aggregations": version,
        "updates_applied": stats.updates_applied,
        "updates_discarded": stats.updates_discarded,
        "bytes_down": b.total_down,
        "bytes_up": b.total_up,
        "bytes_by_kind": {"down": dict(b.down), "up": dict(b.up)},
        "evaluations": len(rec.rows),
        "stop_reason": stop_reason,
        "diagnostics": diagnostics(stats),
        "provenance": provenance(run_settings),
    }
    if extra:
        out.update(extra)
    return out


def make_output_dir(path: Path, what: str = "output folder") -> Path:
    """Create ``path`` (and its parents) before a run starts: a folder that cannot be made (a file
    of that name, no permission) is a ``ConfigError`` at once, not a traceback once results exist."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    return path


def strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float (numpy's too) replaced by None: summary.json is
    strict JSON (RFC 8259 has no NaN or Infinity), whatever a measurement came out as."""
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return None
    return value


def write_run(out_dir: Path, summ: dict[str, Any], rows: list[EvalRow], plots: bool = True) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json(summ), indent=2, sort_keys=True, allow_nan=False)
    (out_dir / "summary.json").write_text(text + "\n")
    EvalLog(out_dir / "evaluations.csv", epsilon="privacy" in summ).reset(rows)
    if plots:
        plot_curves(out_dir, {summ["strategy"]: rows}, summ["target_accuracy"])


class EvalLog:
    """``evaluations.csv`` written as the evaluations happen (the run controller's sink), so that a
    run stopped by a signal, or killed, still leaves what it measured. ``reset`` rewrites the file
    from the rows given (a fresh run: none; a resumed one: those restored); ``write_run`` rewrites
    it whole at the end, so no row is ever written twice."""

    def __init__(self, path: Path, epsilon: bool = False) -> None:
        self.path = path
        self.columns = [*EVAL_COLUMNS, "epsilon"] if epsilon else EVAL_COLUMNS

    def reset(self, rows: list[EvalRow]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self._dict(r) for r in rows)

    def append(self, row: EvalRow) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(self._dict(row))

    def _dict(self, row: EvalRow) -> dict[str, Any]:
        d = asdict(row)
        return {k: d[k] for k in self.columns}


def plot_curves(
    out_dir: Path, curves: dict[str, list[EvalRow]], target: float | None, prefix: str = ""
) -> list[Path]:
    """Accuracy against virtual time and against total bytes, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for xkey, xlabel, fname in (
        ("time_s", "virtual time (h)", "accuracy_vs_time.png"),
        ("bytes_total", "total bytes (MB)", "accuracy_vs_bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        scale = 3600.0 if xkey == "time_s" else 1e6
        for name, rows in curves.items():
            ax.plot([getattr(r, xkey) / scale for r in rows], [r.accuracy for r in rows], label=name, lw=1.4)
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target:g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{prefix}{fname}"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
