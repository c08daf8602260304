"""How fresh a model stays on streaming data (``stream:``; docs/streaming.md).

The global model is judged on the *current* distribution: the test set reweighted to the class
mix of the data arriving at that instant, sum_c mix_c(t) acc_c, where acc_c is the model's
accuracy on the test samples of class c. Each evaluation keeps the per-class accuracies, so the
curve over time is exact between evaluations too: the model held from one evaluation to the
next is judged on the mix as it moves (a surge lowers the curve at once, before any new model).

From the curve on a regular grid: its time average over the run (the area under the curve over
the run's length), the time to recover after each shift (back within a tolerance of the mean
level over a stretch before it), and the model's data age: time since the newest sample behind
any update applied to it so far.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from felix.core.commands import NewModelVersion


def time_average(times: np.ndarray, values: np.ndarray, end: float) -> float | None:
    """The time average over [times[0], end] of a step curve (each value held until the next time)."""
    t = np.asarray(times, dtype=np.float64)
    if not len(t) or end <= t[0]:
        return None
    widths = np.diff(np.append(np.minimum(t, end), end))
    return float(np.sum(widths * np.asarray(values)) / (end - t[0]))


def recovery_time(
    times: np.ndarray, acc: np.ndarray, shift_at: float, tolerance: float, before_s: float, until: float
) -> tuple[float | None, float | None]:
    """``(level, recovery)`` for a shift at ``shift_at`` on a step curve ``acc`` over ``times``:
    the level is the curve's mean over [shift_at - before_s, shift_at) (None: no point there);
    recovery is the time from the shift to the first point at or after it where the curve is
    within ``tolerance`` of that level (0 if it never left), None if that does not happen before
    ``until`` (the next shift or the run's end)."""
    t, a = np.asarray(times), np.asarray(acc)
    before = (t >= shift_at - before_s) & (t < shift_at)
    if not before.any():
        return None, None
    level = float(a[before].mean())
    after = np.flatnonzero((t >= shift_at) & (t < until) & (a >= level - tolerance))
    if not len(after):
        return level, None
    return level, float(t[after[0]] - shift_at)


@dataclass
class _Eval:
    time_s: float
    version: int
    acc: np.ndarray  # per class
    loss: np.ndarray
    newest_data: float | None  # the model's newest data when evaluated


class ShiftMark(Protocol):
    """A moment the stream's global mix shifts, as the tracker reads it (``felix.stream.drift.Shift``
    is one): the metrics layer measures recovery after it and knows no stream."""

    @property
    def at_s(self) -> float: ...

    @property
    def kind(self) -> str: ...


class FreshnessTracker:
    """Accuracy on the current distribution for a run on streams: the recorder's ``evaluate_at``
    and an aggregation hook (the model's newest data), then the summary and ``freshness.csv``.
    ``evaluate``: a model's accuracy and mean loss on each class's test samples (the run's
    ``felix.metrics.test_pass.TestPass.per_class``)."""

    def __init__(
        self,
        evaluate: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
        mix_at: Callable[[float], np.ndarray],
        shifts: Sequence[ShiftMark],
        tolerance: float,
        before_s: float,
        grid_s: float,
    ) -> None:
        self.evaluate = evaluate
        self.mix_at = mix_at
        self.shifts = shifts
        self.tolerance = tolerance
        self.before_s = before_s
        self.grid_s = grid_s
        self.evals: list[_Eval] = []
        self.newest_data: float | None = None
        self.updates_with_span = 0

    def state_dict(self) -> dict[str, Any]:
        """The evaluations so far and the newest data behind the model, columnar like the
        recorder's rows: the MQTT server's checkpoint holds them, so a resumed run keeps its curve."""
        ev = self.evals
        return {
            "time_s": np.array([e.time_s for e in ev], dtype=np.float64),
            "version": np.array([e.version for e in ev], dtype=np.int64),
            "acc": np.array([e.acc for e in ev], dtype=np.float64) if ev else np.zeros((0, 0)),
            "loss": np.array([e.loss for e in ev], dtype=np.float64) if ev else np.zeros((0, 0)),
            "newest_data": np.array([np.nan if e.newest_data is None else e.newest_data for e in ev]),
            "newest": self.newest_data,
            "updates_with_span": self.updates_with_span,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        times, versions, newest = state["time_s"], state["version"], state["newest_data"]
        acc, loss = np.asarray(state["acc"]), np.asarray(state["loss"])
        if not len(times) == len(versions) == len(newest) == len(acc) == len(loss):
            raise ValueError("the freshness state's columns differ in length")
        self.evals = [
            _Eval(float(t), int(v), a.copy(), lo.copy(), None if np.isnan(nd) else float(nd))
            for t, v, a, lo, nd in zip(times, versions, acc, loss, newest, strict=True)
        ]
        self.newest_data = None if state["newest"] is None else float(state["newest"])
        self.updates_with_span = int(state["updates_with_span"])

    def on_aggregation(self, cmd: NewModelVersion) -> None:
        newest = cmd.report.newest_data
        if newest is not None:
            self.updates_with_span += 1
            self.newest_data = newest if self.newest_data is None else max(self.newest_data, newest)

    def evaluate_at(self, time_s: float, version: int, weights: np.ndarray) -> tuple[float, float]:
        acc, loss = self.evaluate(weights)
        self.evals.append(_Eval(time_s, version, acc, loss, self.newest_data))
        mix = self.mix_at(time_s)
        return _mixed(mix, acc), _mixed(mix, loss)

    def curve(self, end: float) -> dict[str, np.ndarray]:
        """On the grid 0, grid_s, ... up to ``end`` (and at every evaluation): the current-mix
        accuracy of the model evaluated last, the test set's plain accuracy, and the data age."""
        if not self.evals:
            return {k: np.zeros(0) for k in ("time_s", "accuracy", "uniform_accuracy", "data_age_s")}
        ev_t = np.array([e.time_s for e in self.evals])
        grid = np.unique(np.concatenate([np.arange(0.0, end, self.grid_s), ev_t[ev_t <= end]]))
        which = np.searchsorted(ev_t, grid, side="right") - 1
        acc: list[float] = []
        plain: list[float] = []
        age: list[float] = []
        for t, k in zip(grid.tolist(), which.tolist()):
            if k < 0:  # before the first evaluation
                for col in (acc, plain, age):
                    col.append(np.nan)
                continue
            e = self.evals[k]
            acc.append(_mixed(self.mix_at(t), e.acc))
            plain.append(float(np.nanmean(e.acc)))
            age.append(np.nan if e.newest_data is None else t - e.newest_data)
        return {
            "time_s": grid,
            "accuracy": np.array(acc),
            "uniform_accuracy": np.array(plain),
            "data_age_s": np.array(age),
        }

    def summary(self, end: float) -> dict[str, Any]:
        """The summary's ``stream`` figures (see the module docstring)."""
        cv = self.curve(end)
        t, a = cv["time_s"], cv["accuracy"]
        ok = ~np.isnan(a)
        shifts = []
        for i, s in enumerate(self.shifts):
            if s.at_s >= end:
                continue
            until = min([x.at_s for x in self.shifts[i + 1 :] if x.at_s > s.at_s] + [end])
            level, rec = recovery_time(t[ok], a[ok], s.at_s, self.tolerance, self.before_s, until)
            shifts.append({"at_s": s.at_s, "kind": s.kind, "level_before": level, "recovery_s": rec})
        recs = [x["recovery_s"] for x in shifts if x["level_before"] is not None]
        age = cv["data_age_s"]
        return {
            "time_avg_accuracy": time_average(t[ok], a[ok], end),
            "time_avg_uniform_accuracy": time_average(t[ok], cv["uniform_accuracy"][ok], end),
            "shifts": shifts,
            "recovery_mean_s": float(np.mean([r for r in recs if r is not None]))
            if any(r is not None for r in recs)
            else None,
            "shifts_not_recovered": sum(r is None for r in recs),
            "data_age_mean_s": time_average(t[~np.isnan(age)], age[~np.isnan(age)], end)
            if (~np.isnan(age)).any()
            else None,
            "data_age_final_s": None if self.newest_data is None else end - self.newest_data,
        }

    def write(self, out_dir: Path, end: float, plot: bool = True) -> None:
        """``freshness.csv`` (the curve) and ``freshness.png``."""
        cv = self.curve(end)
        with open(out_dir / "freshness.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(list(cv))
            for row in zip(*(v.tolist() for v in cv.values())):
                w.writerow([f"{v:.6g}" for v in row])
        if plot:
            plot_freshness(out_dir / "freshness.png", {"run": cv}, [s.at_s for s in self.shifts])


def _mixed(mix: np.ndarray, per_class: np.ndarray) -> float:
    """sum_c mix_c v_c over the classes the test set holds (the mix renormalised over them)."""
    have = ~np.isnan(per_class)
    m = mix[have]
    return float(m @ per_class[have] / m.sum()) if m.sum() > 0 else float("nan")


def plot_freshness(path: Path, curves: dict[str, dict[str, np.ndarray]], shifts: list[float]) -> None:
    """Accuracy on the current distribution against time, one line per run, shifts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, cv in curves.items():
        ax.plot(cv["time_s"] / 3600.0, cv["accuracy"], label=name, lw=1.2)
    for s in shifts:
        ax.axvline(s / 3600.0, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("virtual time (h)")
    ax.set_ylabel("accuracy on the current class mix")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
