"""Comparisons that hold up: several strategies x several seeds x several targets.

A single-seed time to one target is fragile (the FeLiX reproduction flipped its ordering between
0.80 and 0.82). Here every run's evaluation table is re-read against each target with the
authors' rule (``reached_target``), and each strategy's times, bytes and the reference's speed-up
are reported as mean, standard deviation and how many seeds reached the target at all. Speed-ups
are paired by seed: every seed gives both strategies the same clients, data and availability.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from felix.metrics.recorder import EvalRow, reached_target

# strategy -> seed -> that run's evaluation rows
Curves = dict[str, dict[int, list[EvalRow]]]


@dataclass(frozen=True)
class TargetHit:
    """Where one run first met one target: virtual time, total bytes (and those of training and of
    evaluation tasks) and model version."""

    time_s: float
    bytes_total: int
    version: int
    bytes_train: int = 0
    bytes_eval: int = 0


def first_hits(
    rows: Sequence[EvalRow], targets: Sequence[float], window: int
) -> dict[float, TargetHit | None]:
    """For each target, the first evaluation at which the run meets it (None: never)."""
    out: dict[float, TargetHit | None] = {t: None for t in targets}
    accs: list[float] = []
    for r in rows:
        accs.append(r.accuracy)
        for t in targets:
            if out[t] is None and reached_target(accs, t, window):
                out[t] = TargetHit(r.time_s, r.bytes_total, r.version, r.bytes_train, r.bytes_eval)
    return out


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation and range over the seeds that have a value; ``n`` of ``of``."""

    mean: float | None
    std: float | None
    n: int
    of: int
    min: float | None = None
    max: float | None = None

    @classmethod
    def of_values(cls, values: Sequence[float | None]) -> Spread:
        got = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not got:
            return cls(None, None, 0, len(values))
        std = float(np.std(got, ddof=1)) if len(got) > 1 else 0.0
        return cls(float(np.mean(got)), std, len(got), len(values), min(got), max(got))

    def text(self, fmt: str = ".0f", scale: float = 1.0) -> str:
        """``mean ± std``, then ``(n/m reached)`` when some seeds have no value, then ``[min-max]``
        when more than one has."""
        if self.mean is None:
            return f"not reached (0/{self.of})"
        s = f"{self.mean / scale:{fmt}} ± {(self.std or 0.0) / scale:{fmt}}"
        if self.n != self.of:
            s += f" ({self.n}/{self.of} reached)"
        if self.n > 1 and self.min is not None and self.max is not None:
            s += f" [{self.min / scale:{fmt}}-{self.max / scale:{fmt}}]"
        return s


@dataclass(frozen=True)
class StrategyAtTarget:
    time_s: Spread
    bytes_total: Spread
    speedup_of_reference: Spread  # this strategy's time / the reference's time, paired by seed
    bytes_train: Spread  # of bytes_total, training tasks' (model down, update up)
    bytes_eval: Spread  # and evaluation tasks' (model down, utility up)


def compare_seeds(
    curves: Curves, targets: Sequence[float], window: int, reference: str
) -> dict[str, dict[float, StrategyAtTarget]]:
    """Per strategy and target: time and bytes to target and the reference's speed-up, over seeds.

    A seed where either side never reaches the target gives no speed-up value (it is counted in
    ``of`` but not in ``n``), so a strategy that often fails cannot look fast."""
    if reference not in curves:
        raise ValueError(f"reference strategy {reference!r} is not among {sorted(curves)}")
    hits = {
        s: {seed: first_hits(rows, targets, window) for seed, rows in runs.items()}
        for s, runs in curves.items()
    }
    out: dict[str, dict[float, StrategyAtTarget]] = {}
    for s, by_seed in hits.items():
        out[s] = {}
        for t in targets:
            at_t = [h[t] for h in by_seed.values()]
            times = [x.time_s if x else None for x in at_t]
            nbytes = [float(x.bytes_total) if x else None for x in at_t]
            ntrain = [float(x.bytes_train) if x else None for x in at_t]
            neval = [float(x.bytes_eval) if x else None for x in at_t]
            ratios: list[float | None] = []
            for seed, h in by_seed.items():
                ref = hits[reference].get(seed, {}).get(t)
                mine = h[t]
                ratios.append(mine.time_s / ref.time_s if mine and ref and ref.time_s > 0 else None)
            out[s][t] = StrategyAtTarget(
                Spread.of_values(times),
                Spread.of_values(nbytes),
                Spread.of_values(ratios),
                Spread.of_values(ntrain),
                Spread.of_values(neval),
            )
    return out


def table_markdown(
    stats: dict[str, dict[float, StrategyAtTarget]],
    reference: str,
    title: str,
    interrupted: Collection[str] = (),
) -> str:
    """One row per strategy; for each target: time (s), MB (all, then of training and of evaluation
    tasks) and the reference's speed-up, mean ± std. A strategy in ``interrupted`` (some run of it
    was stopped by Ctrl-C or SIGTERM) is marked so, and its unmet targets read "interrupted"."""
    targets = list(next(iter(stats.values())))
    head = (
        "| strategy | "
        + " | ".join(
            f"time to {t:g} (s) | MB to {t:g} | train MB to {t:g} | eval MB to {t:g} "
            f"| speed-up of {reference} at {t:g}"
            for t in targets
        )
        + " |"
    )
    lines = [
        f"# {title}",
        "",
        (
            f"Mean ± standard deviation over seeds; speed-up = strategy's time / {reference}'s time on the "
            "same seed (above 1: the reference is faster); '(n/m reached)' when not every seed met the target. "
            "Train / eval MB: the bytes of training and of evaluation tasks (both directions); "
            "the rest of MB is control traffic."
        ),
        "",
        head,
        "|---|" + "---|---|---|---|---|" * len(targets),
    ]
    for s, per_t in stats.items():
        cells = []
        for t in targets:
            a = per_t[t]
            speed = (
                "-"
                if s == reference
                else (
                    a.speedup_of_reference.text(".2f") + "x"
                    if a.speedup_of_reference.mean is not None
                    else "-"
                )
            )
            time_cell = a.time_s.text()
            if s in interrupted and a.time_s.mean is None:
                time_cell = f"interrupted (0/{a.time_s.of} reached)"
            cells += [
                time_cell,
                a.bytes_total.text(".1f", 1e6),
                a.bytes_train.text(".1f", 1e6),
                a.bytes_eval.text(".1f", 1e6),
                speed,
            ]
        lines.append(f"| {s}{' (interrupted)' if s in interrupted else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def stats_json(stats: dict[str, dict[float, StrategyAtTarget]]) -> dict[str, dict[str, Any]]:
    return {s: {f"{t:g}": asdict(a) for t, a in per_t.items()} for s, per_t in stats.items()}


def time_axis_limit(stats: dict[str, dict[float, StrategyAtTarget]], curves: Curves) -> float:
    """Twice the slowest mean time to any target that some strategy reached, so the plots show the
    race rather than a never-finishing run's 12 hours; the whole run when nothing was reached."""
    reached = [a.time_s.mean for per_t in stats.values() for a in per_t.values() if a.time_s.mean is not None]
    if reached:
        return 2.0 * max(reached)
    return max((rows[-1].time_s for runs in curves.values() for rows in runs.values() if rows), default=1.0)


def plot_comparison(
    out_dir: Path,
    curves: Curves,
    stats: dict[str, dict[float, StrategyAtTarget]],
    prefix: str = "comparison_",
) -> list[Path]:
    """Accuracy against time (mean over seeds, min-max band, zoomed), time to each target and MB to
    each target (error bars = std over seeds, not-reached marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(next(iter(stats.values())))
    xmax = time_axis_limit(stats, curves)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    _accuracy_panel(ax, curves, stats, "time_s", xmax, 3600.0)
    ax.set_xlabel("virtual time (h); band: min-max over seeds")
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}accuracy_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    names = list(stats)
    width = 0.8 / max(1, len(targets))
    longest = max((a.time_s.mean or 0.0) + (a.time_s.std or 0.0) for p in stats.values() for a in p.values())
    hours = longest > 3 * 3600.0
    for key, ylabel, scale, fname in (
        (
            "time_s",
            "time to target " + ("(h)" if hours else "(s)"),
            3600.0 if hours else 1.0,
            "time_to_target.png",
        ),
        ("bytes_total", "MB to target", 1e6, "bytes_to_target.png"),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        ax.set_title("mean ± std over seeds; k/n: seeds that reached it; n.r.: not reached", fontsize=8)
        tops = [
            (getattr(a, key).mean or 0.0) + (getattr(a, key).std or 0.0)
            for p in stats.values()
            for a in p.values()
        ]
        cap = max(tops) / scale if max(tops) > 0 else 1.0
        for j, target in enumerate(targets):
            xs = np.arange(len(names)) + (j - (len(targets) - 1) / 2) * width
            vals = [getattr(stats[n][target], key) for n in names]
            means = [v.mean / scale if v.mean is not None else 0.0 for v in vals]
            errs = [(v.std or 0.0) / scale if v.mean is not None else 0.0 for v in vals]
            ax.bar(xs, means, width, yerr=errs, capsize=2, label=f"target {target:g}")
            for x, v in zip(xs, vals):
                if v.mean is None:
                    ax.text(x, 0, "n.r.", ha="center", va="bottom", fontsize=6, rotation=90)
                elif v.n < v.of:
                    ax.text(x, v.mean / scale, f"{v.n}/{v.of}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
        ax.set_ylim(0, cap * 1.15)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}{fname}")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _reached_label(name: str, runs: dict[int, list[EvalRow]], per_t: dict[float, StrategyAtTarget]) -> str:
    """Legend text: the seed count, and how many seeds reached the highest target when not all did."""
    top = per_t[max(per_t)].time_s
    label = f"{name} ({len(runs)} seeds)"
    return label if top.n == top.of else f"{name} ({top.n}/{top.of} seeds reached {max(per_t):g})"


def _accuracy_panel(
    ax: Any,
    curves: Curves,
    stats: dict[str, dict[float, StrategyAtTarget]],
    xkey: str,
    xmax: float,
    scale: float,
) -> None:
    """Mean accuracy over seeds against ``xkey`` (time_s or bytes_total) up to ``xmax``, with a
    min-max band; each run holds its last accuracy after it ends. A strategy that did not reach the
    highest target on every seed says so in the legend."""
    grid = np.linspace(0.0, xmax, 400)
    for s, runs in curves.items():
        ys = []
        for rows in runs.values():
            if not rows:
                continue
            x = np.array([getattr(r, xkey) for r in rows], dtype=float)
            a = np.array([r.accuracy for r in rows])
            # the accuracy in force at each grid point (step function); after a run ends, its last value
            ys.append(a[np.clip(np.searchsorted(x, grid, side="right") - 1, 0, len(a) - 1)])
        if not ys:
            continue
        y = np.vstack(ys)
        (line,) = ax.plot(grid / scale, y.mean(0), lw=1.4, label=_reached_label(s, runs, stats[s]))
        ax.fill_between(grid / scale, y.min(0), y.max(0), color=line.get_color(), alpha=0.18, lw=0)
    targets = list(next(iter(stats.values())))
    for target in targets:
        ax.axhline(target, color="grey", ls="--", lw=0.7)
    ax.set_xlim(0, xmax / scale)
    # The race is decided near the targets: start the accuracy axis 0.2 below the lowest.
    ax.set_ylim(bottom=max(0.0, min(targets) - 0.2))
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def bytes_axis_limit(stats: dict[str, dict[float, StrategyAtTarget]], curves: Curves) -> float:
    """Like ``time_axis_limit``, in bytes: twice the largest mean bytes to a reached target."""
    reached = [
        a.bytes_total.mean
        for per_t in stats.values()
        for a in per_t.values()
        if a.bytes_total.mean is not None
    ]
    if reached:
        return 2.0 * max(reached)
    return float(
        max((rows[-1].bytes_total for runs in curves.values() for rows in runs.values() if rows), default=1)
    )


def plot_accuracy_vs_bytes(
    out_dir: Path,
    curves: Curves,
    stats: dict[str, dict[float, StrategyAtTarget]],
    prefix: str = "comparison_",
) -> Path:
    """Accuracy against total bytes (mean over seeds, min-max band), zoomed like the time plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    _accuracy_panel(ax, curves, stats, "bytes_total", bytes_axis_limit(stats, curves), 1e6)
    ax.set_xlabel("total bytes (MB); band: min-max over seeds")
    fig.tight_layout()
    path = out_dir / f"{prefix}accuracy_vs_bytes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
