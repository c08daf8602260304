"""Comparisons that hold up: several strategies x several seeds x several targets.

A single-seed time to one target is fragile (the FeLiX reproduction flipped its ordering between
0.80 and 0.82). Here every run's evaluation table is re-read against each target with the
authors' rule (``reached_target``), and each strategy's times, bytes and the reference's speed-up
are reported as mean, standard deviation and how many seeds reached the target at all. Speed-ups
are paired by seed: every seed gives both strategies the same clients, data and availability.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from felix.metrics.recorder import EvalRow, reached_target

# strategy -> seed -> that run's evaluation rows
Curves = dict[str, dict[int, list[EvalRow]]]


@dataclass(frozen=True)
class TargetHit:
    """Where one run first met one target: virtual time, total bytes and model version."""

    time_s: float
    bytes_total: int
    version: int


def first_hits(rows: Sequence[EvalRow], targets: Sequence[float], window: int) -> dict[float, TargetHit | None]:
    """For each target, the first evaluation at which the run meets it (None: never)."""
    out: dict[float, TargetHit | None] = {t: None for t in targets}
    accs: list[float] = []
    for r in rows:
        accs.append(r.accuracy)
        for t in targets:
            if out[t] is None and reached_target(accs, t, window):
                out[t] = TargetHit(r.time_s, r.bytes_total, r.version)
    return out


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation over the seeds that have a value; ``n`` of ``of``."""

    mean: float | None
    std: float | None
    n: int
    of: int

    @classmethod
    def of_values(cls, values: Sequence[float | None]) -> Spread:
        got = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not got:
            return cls(None, None, 0, len(values))
        std = float(np.std(got, ddof=1)) if len(got) > 1 else 0.0
        return cls(float(np.mean(got)), std, len(got), len(values))

    def text(self, fmt: str = ".0f", scale: float = 1.0) -> str:
        if self.mean is None:
            return f"not reached (0/{self.of})"
        s = f"{self.mean / scale:{fmt}} ± {(self.std or 0.0) / scale:{fmt}}"
        return s if self.n == self.of else f"{s} ({self.n}/{self.of} reached)"


@dataclass(frozen=True)
class StrategyAtTarget:
    time_s: Spread
    bytes_total: Spread
    speedup_of_reference: Spread  # this strategy's time / the reference's time, paired by seed


def compare_seeds(curves: Curves, targets: Sequence[float], window: int, reference: str
                  ) -> dict[str, dict[float, StrategyAtTarget]]:
    """Per strategy and target: time and bytes to target and the reference's speed-up, over seeds.

    A seed where either side never reaches the target gives no speed-up value (it is counted in
    ``of`` but not in ``n``), so a strategy that often fails cannot look fast."""
    if reference not in curves:
        raise ValueError(f"reference strategy {reference!r} is not among {sorted(curves)}")
    hits = {s: {seed: first_hits(rows, targets, window) for seed, rows in runs.items()} for s, runs in curves.items()}
    out: dict[str, dict[float, StrategyAtTarget]] = {}
    for s, by_seed in hits.items():
        out[s] = {}
        for t in targets:
            times = [h[t].time_s if h[t] else None for h in by_seed.values()]
            nbytes = [float(h[t].bytes_total) if h[t] else None for h in by_seed.values()]
            ratios: list[float | None] = []
            for seed, h in by_seed.items():
                ref = hits[reference].get(seed, {}).get(t)
                mine = h[t]
                ratios.append(mine.time_s / ref.time_s if mine and ref and ref.time_s > 0 else None)
            out[s][t] = StrategyAtTarget(Spread.of_values(times), Spread.of_values(nbytes), Spread.of_values(ratios))
    return out


def table_markdown(stats: dict[str, dict[float, StrategyAtTarget]], reference: str, title: str) -> str:
    """One row per strategy; for each target: time (s), MB and the reference's speed-up, mean ± std."""
    targets = list(next(iter(stats.values())))
    head = "| strategy | " + " | ".join(
        f"time to {t:g} (s) | MB to {t:g} | speed-up of {reference} at {t:g}" for t in targets) + " |"
    lines = [f"# {title}", "",
             (f"Mean ± standard deviation over seeds; speed-up = strategy's time / {reference}'s time on the "
              "same seed (above 1: the reference is faster); '(n/m reached)' when not every seed met the target."),
             "", head, "|---|" + "---|---|---|" * len(targets)]
    for s, per_t in stats.items():
        cells = []
        for t in targets:
            a = per_t[t]
            speed = "-" if s == reference else (a.speedup_of_reference.text(".2f") + "x"
                                                if a.speedup_of_reference.mean is not None else "-")
            cells += [a.time_s.text(), a.bytes_total.text(".1f", 1e6), speed]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
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


def plot_comparison(out_dir: Path, curves: Curves, stats: dict[str, dict[float, StrategyAtTarget]],
                    prefix: str = "comparison_") -> list[Path]:
    """Accuracy against time (mean over seeds, min-max band, zoomed), time to each target and MB to
    each target (error bars = std over seeds, not-reached marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(next(iter(stats.values())))
    xmax = time_axis_limit(stats, curves)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    grid = np.linspace(0.0, xmax, 400)
    for s, runs in curves.items():
        ys = []
        for rows in runs.values():
            if not rows:
                continue
            t = np.array([r.time_s for r in rows])
            a = np.array([r.accuracy for r in rows])
            # the accuracy in force at each grid time (step function); after a run ends, its last value
            ys.append(a[np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(a) - 1)])
        if not ys:
            continue
        y = np.vstack(ys)
        line, = ax.plot(grid / 3600, y.mean(0), lw=1.4, label=f"{s} ({len(ys)} seeds)")
        ax.fill_between(grid / 3600, y.min(0), y.max(0), color=line.get_color(), alpha=0.18, lw=0)
    for t in targets:
        ax.axhline(t, color="grey", ls="--", lw=0.7)
    ax.set_xlim(0, xmax / 3600)
    ax.set_xlabel("virtual time (h); band: min-max over seeds")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}accuracy_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    names = list(stats)
    width = 0.8 / max(1, len(targets))
    for key, ylabel, scale, fname in (("time_s", "time to target (h)", 3600.0, "time_to_target.png"),
                                      ("bytes_total", "MB to target", 1e6, "bytes_to_target.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        tops = [(getattr(a, key).mean or 0.0) + (getattr(a, key).std or 0.0) for p in stats.values() for a in p.values()]
        cap = max(tops) / scale if max(tops) > 0 else 1.0
        for j, t in enumerate(targets):
            xs = np.arange(len(names)) + (j - (len(targets) - 1) / 2) * width
            vals = [getattr(stats[n][t], key) for n in names]
            means = [v.mean / scale if v.mean is not None else 0.0 for v in vals]
            errs = [(v.std or 0.0) / scale if v.mean is not None else 0.0 for v in vals]
            ax.bar(xs, means, width, yerr=errs, capsize=2, label=f"target {t:g}")
            for x, v in zip(xs, vals):
                if v.mean is None:
                    ax.text(x, 0, "n.r.", ha="center", va="bottom", fontsize=6, rotation=90)
                elif v.n < v.of:
                    ax.text(x, v.mean / scale, f"{v.n}/{v.of}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
        ax.set_ylim(0, cap * 1.15)
        ax.set_ylabel(ylabel + " (mean ± std over seeds; n.r.: not reached)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}{fname}")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
