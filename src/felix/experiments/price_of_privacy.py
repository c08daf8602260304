"""The price of privacy read from a dp-* comparison: its variants are ``<strategy>-eps<e>``
(``-epsinf``: the same orchestration without privacy), and these tables set the strategies
against epsilon. One implementation for both readers: docs/privacy.md's Markdown tables
(``benchmarks/dp_tables.py``) and the privacy pages of ``felix report``
(``felix.experiments.html_report``).

Each table is a header and rows of cell texts: the last evaluation's accuracy (mean ± sd over the
seeds, and the largest epsilon spent); the virtual time to a target (mean ± sd over the seeds that
reached it, "not reached (k/n)" when some did not); felix's accuracy minus each other strategy's,
paired by seed; the noise multipliers and epsilon spent. A variant that did not run is "not run".
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

#: The dp-* comparisons' strategies and epsilons, in the tables' order; others found follow.
STRATEGIES = ("felix", "felix-authors", "oort-async*", "fedbuff", "oort*", "fedavg")
EPSILONS = ("1", "2", "4", "8", "inf")
_VARIANT = re.compile(r"^(?P<strategy>.+)-eps(?P<eps>inf|\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class Table:
    """A header (the first column's title, then one per epsilon) and rows of cell texts."""

    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> list[str]:
        out = ["| " + " | ".join(self.header) + " |", "|---|" + "---:|" * (len(self.header) - 1)]
        return out + ["| " + " | ".join(r) + " |" for r in self.rows]


@dataclass(frozen=True)
class Grid:
    """The strategies and epsilons of a comparison's ``runs`` (variant -> seed -> summary)."""

    runs: dict[str, dict[str, Any]]
    strategies: tuple[str, ...]
    epsilons: tuple[str, ...]

    def seeds(self, strategy: str, eps: str) -> dict[str, Any] | None:
        return self.runs.get(f"{strategy}-eps{eps}") or None


def grid(runs: dict[str, dict[str, Any]]) -> Grid:
    """The strategy x epsilon grid of ``runs``: the dp-* comparisons' order, then any other
    strategy (by name) and epsilon (by value) its variant names hold."""
    found = [m for v in runs if (m := _VARIANT.match(v))]
    strategies = {m["strategy"] for m in found}
    epsilons = {m["eps"] for m in found}
    return Grid(
        runs,
        tuple(s for s in STRATEGIES if s in strategies) + tuple(sorted(strategies - set(STRATEGIES))),
        tuple(sorted(epsilons, key=lambda e: math.inf if e == "inf" else float(e))),
    )


def is_private_comparison(runs: dict[str, dict[str, Any]]) -> bool:
    """Whether ``runs`` holds a private ``-eps<e>`` variant (a run that reports its privacy)."""
    return any(_VARIANT.match(v) and any("privacy" in r for r in seeds.values()) for v, seeds in runs.items())


def mean_sd(xs: list[float], digits: int) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.{digits}f} ± {sd:.{digits}f}"


def _header(first: str, epsilons: tuple[str, ...]) -> list[str]:
    return [first] + [f"ε = {e}" if e != "inf" else "no DP (ε = ∞)" for e in epsilons]


def accuracy_points(g: Grid) -> dict[str, list[tuple[str, list[float]]]]:
    """Per strategy, each epsilon it ran at and its seeds' last-evaluation accuracies."""
    return {
        s: [
            (e, [float(r["final_accuracy"]) for r in seeds.values()])
            for e in g.epsilons
            if (seeds := g.seeds(s, e))
        ]
        for s in g.strategies
    }


def accuracy_table(g: Grid) -> Table:
    rows = []
    for s in g.strategies:
        cells = [s]
        for e in g.epsilons:
            seeds = g.seeds(s, e)
            if not seeds:
                cells.append("not run")
                continue
            acc = [r["final_accuracy"] for r in seeds.values()]
            cell = f"{mean_sd(acc, 3)} (n={len(acc)})"
            if e != "inf":
                eps = max(r["privacy"]["epsilon"] for r in seeds.values())
                cell += f", ε {eps:.2f}"
            cells.append(cell)
        rows.append(cells)
    return Table(_header("strategy", g.epsilons), rows)


def time_table(g: Grid, stats: dict[str, Any], target: str) -> Table:
    """Virtual seconds to ``target`` (its key in the comparison's ``stats``)."""
    rows = []
    for s in g.strategies:
        cells = [s]
        for e in g.epsilons:
            v = f"{s}-eps{e}"
            if not g.seeds(s, e):
                cells.append("not run")
                continue
            st = stats[v][target]["time_s"]
            if not st.get("n"):
                cells.append(f"not reached (0/{st.get('of', len(g.runs[v]))})")
                continue
            cell = f"{st['mean']:.0f} ± {st.get('std') or 0.0:.0f}"
            cells.append(cell + ("" if st["n"] == st["of"] else f" ({st['n']}/{st['of']} reached)"))
        rows.append(cells)
    return Table(_header(f"time to {target} (s)", g.epsilons), rows)


def paired_table(g: Grid, reference: str = "felix") -> Table:
    """``reference``'s last accuracy minus each other strategy's, paired by seed (mean
    [min..max]), at each private epsilon (without privacy the runs stop at the highest target:
    their last accuracies compare nothing)."""
    private = tuple(e for e in g.epsilons if e != "inf")
    rows = []
    for s in g.strategies:
        if s == reference:
            continue
        cells = [s]
        for e in private:
            a, b = g.seeds(reference, e), g.seeds(s, e)
            common = sorted(set(a or {}) & set(b or {}))
            if not common:
                cells.append("-")
                continue
            assert a is not None and b is not None
            d = [a[k]["final_accuracy"] - b[k]["final_accuracy"] for k in common]
            cells.append(f"{statistics.fmean(d):+.3f} [{min(d):+.3f}..{max(d):+.3f}]")
        rows.append(cells)
    return Table(_header(f"{reference} minus", private), rows)


def noise_table(g: Grid) -> Table:
    """Per private variant: the updates' noise multiplier, the reports' (when its reports are
    private), and the epsilon its runs spent (min..max over seeds) at the aggregations they took."""
    private = tuple(e for e in g.epsilons if e != "inf")
    rows = []
    for s in g.strategies:
        cells = [s]
        for e in private:
            seeds = g.seeds(s, e)
            if not seeds:
                cells.append("not run")
                continue
            ps = [r["privacy"] for r in seeds.values()]
            sigmas = sorted({p["noise_multiplier"] for p in ps})
            cell = "σ " + " / ".join(f"{x:g}" for x in sigmas)
            reports = sorted({p["reports"]["noise_multiplier"] for p in ps if p.get("reports")})
            cell += (
                ", reports σ " + " / ".join(f"{x:g}" for x in reports) if reports else ", reports not noised"
            )
            spent = [p["epsilon"] for p in ps]
            aggs = sorted({p["aggregations"] for p in ps})
            span = (
                f"{min(spent):.2f}"
                if max(spent) - min(spent) < 0.005
                else f"{min(spent):.2f}..{max(spent):.2f}"
            )
            cell += f"; ε {span} after {'/'.join(str(a) for a in aggs)} aggregations"
            cells.append(cell)
        rows.append(cells)
    return Table(_header("noise, ε spent", private), rows)


__all__ = [
    "EPSILONS",
    "STRATEGIES",
    "Grid",
    "Table",
    "accuracy_points",
    "accuracy_table",
    "grid",
    "is_private_comparison",
    "mean_sd",
    "noise_table",
    "paired_table",
    "time_table",
]
