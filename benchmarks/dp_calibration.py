"""The noise multipliers of the dp-* comparisons, calibrated with the run's own accounting.

Each private variant's budget (``privacy.target_epsilon``) must last a given number of
aggregations: the smallest noise multiplier (to 0.01, rounded up) at which
``felix.privacy.budget.PrivacyBudget`` lets the run take that many. Strategies that read their
clients' reported losses and utilities (felix's probes and TierFuse, Oort's statistical utility),
which a private run must noise, first give ``--reports-share`` of the budget to their reports (the smallest report noise whose
epsilon alone is within that share), then calibrate the updates' noise with the reports composed.
Printed as the comparison file's variant lines, or with ``--comparison`` written into that shipped
comparison file in place of its ``variants:`` block, so the numbers in the file are this script's;
the family's buffer size and concurrency are arguments (the Fashion-MNIST family's are the defaults).

    python benchmarks/dp_calibration.py --aggregations 127 --comparison dp-fmnist-90
    python benchmarks/dp_calibration.py --aggregations 127 --agg-goal 50 --concurrency 150 \
        --comparison dp-fsdd-mobiperf
    python benchmarks/dp_calibration.py --aggregations 127 --agg-goal 50 --concurrency 150 \
        --mechanism banded_mf --bands 16 --comparison dp-fsdd-mobiperf-banded

``--mechanism banded_mf --bands B`` calibrates the banded factorisation instead of the tree (its
sensitivity for B bands, the participations the separation allows, under the same cap).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

import felix
from felix.privacy.accountant import Accountant

STRATEGIES = ("felix", "felix-authors", "oort-async*", "fedbuff", "oort*", "fedavg")
#: Their selector, eval selector or aggregator reads reports: a private run needs ``privacy.reports``.
READS_REPORTS = ("felix", "felix-authors", "oort-async*", "oort*")
ASYNC = ("felix", "felix-authors", "oort-async*", "fedbuff")
#: The shipped comparison files, which ``--comparison`` rewrites.
COMPARISONS = Path(felix.__file__).parent / "configs" / "comparisons"
#: A comparison file's variants block: the ``variants:`` line and its indented lines.
VARIANTS_BLOCK = re.compile(r"^variants:\n(?:[ #].*\n)*", re.MULTILINE)
#: Without privacy these keep their preset's sample-weighted mean: their weights are sample counts,
#: so dividing the weighted sum by the cohort size would multiply the step by the mean count.
SAMPLE_WEIGHTED = ("oort*", "fedavg")


def smallest(ok: Callable[[float], bool], lo: float = 0.01, hi: float = 1e4) -> float:
    """The smallest sigma on the 0.01 grid with ``ok(sigma)`` (``ok`` is monotone in sigma)."""
    a, b = math.ceil(lo * 100), math.ceil(hi * 100)
    assert ok(b / 100), "no noise multiplier up to the bound meets the budget"
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (a, mid) if ok(mid / 100) else (mid, b)
    return b / 100


def calibrate(
    epsilon: float,
    steps: int,
    delta: float,
    cap: int,
    reports: tuple[float, int] | None,
    mechanism: str = "dp_ftrl",
    bands: int | None = None,
) -> float:
    """The update noise multiplier at which ``steps`` aggregations stay within ``epsilon``."""

    def ok(sigma: float) -> bool:
        acc = Accountant(mechanism, sigma, delta, max_participations=cap, reports=reports, bands=bands)
        return acc.epsilon_after(steps) <= epsilon

    return smallest(ok)


def report_noise(epsilon: float, count: int, delta: float) -> float:
    """The report noise multiplier whose ``count`` reports alone spend at most ``epsilon``."""

    def ok(sigma: float) -> bool:
        acc = Accountant("dp_ftrl", 1.0, delta, reports=(sigma, count))
        return acc.epsilon_after(0) <= epsilon

    return smallest(ok)


def variant_lines(a: argparse.Namespace) -> list[str]:
    """The comparison file's variant lines: each strategy at each epsilon, then without privacy."""
    lines = []
    for s in STRATEGIES:
        orch = f"orchestrator.agg_goal: {a.agg_goal}"
        if s in ASYNC:
            orch += f", orchestrator.concurrency: {a.concurrency}"
        head = f'{{strategy: "{s}", {orch}, aggregator.normalize: count'
        for eps in a.epsilons:
            reports = None
            extra = ""
            if s in READS_REPORTS:
                rs = report_noise(eps * a.reports_share, a.reports_per_client, a.delta)
                reports = (rs, a.reports_per_client)
                extra = (
                    f", reports: {{noise_multiplier: {rs:g}, clip: {a.report_clip}, "
                    f"max_per_client: {a.reports_per_client}}}"
                )
            sigma = calibrate(
                eps, a.aggregations, a.delta, a.max_participations, reports, a.mechanism, a.bands
            )
            bands = "" if a.bands is None else f"bands: {a.bands}, "
            priv = (
                f"privacy: {{mechanism: {a.mechanism}, {bands}noise_multiplier: {sigma:g}, clip_norm: {a.clip}, "
                f"delta: {a.delta:g}, max_participations: {a.max_participations}, "
                f"target_epsilon: {eps:g}{extra}}}"
            )
            lines.append(f'  "{s}-eps{eps:g}": {head}, {priv}}}')
        plain = head.replace(", aggregator.normalize: count", "") if s in SAMPLE_WEIGHTED else head
        lines.append(f'  "{s}-epsinf": {plain}}}')
    return lines


def with_variants(text: str, lines: list[str]) -> str:
    """A comparison file's text with its ``variants:`` block replaced by ``lines``."""
    if len(VARIANTS_BLOCK.findall(text)) != 1:
        raise ValueError("the comparison file needs exactly one top-level 'variants:' block")
    return VARIANTS_BLOCK.sub(lambda _: "variants:\n" + "".join(f"{line}\n" for line in lines), text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aggregations", type=int, required=True, help="how long each budget must last")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=0.5)
    ap.add_argument("--max-participations", type=int, default=5)
    ap.add_argument("--agg-goal", type=int, default=100, help="the family's buffer / cohort size K")
    ap.add_argument("--concurrency", type=int, default=300, help="the async strategies' clients running")
    ap.add_argument("--reports-share", type=float, default=0.25)
    ap.add_argument("--report-clip", type=float, default=10.0)
    ap.add_argument("--reports-per-client", type=int, default=20)
    ap.add_argument("--mechanism", choices=("dp_ftrl", "banded_mf"), default="dp_ftrl")
    ap.add_argument("--bands", type=int, help="banded_mf's bands (required with it)")
    ap.add_argument(
        "--comparison",
        help="a shipped dp-* comparison (e.g. dp-fsdd-mobiperf) whose variants block to rewrite; "
        "without it the lines are printed",
    )
    a = ap.parse_args(argv)
    if (a.mechanism == "banded_mf") != (a.bands is not None):
        ap.error("--bands goes with --mechanism banded_mf, and banded_mf needs --bands")
    if a.bands is not None and a.bands < 1:
        ap.error(f"--bands must be at least 1, not {a.bands}")
    return a


def main() -> None:
    a = parse_args()
    lines = variant_lines(a)
    if a.comparison is None:
        print("\n".join(lines))
        return
    path = COMPARISONS / f"{a.comparison}.yaml"
    if not path.is_file():
        raise SystemExit(f"--comparison {a.comparison}: no shipped comparison of that name ({path.name})")
    try:
        path.write_text(with_variants(path.read_text(), lines))
    except ValueError as exc:
        raise SystemExit(f"{path.name}: {exc}") from None
    print(f"wrote {len(lines)} variants into {path.name}")


if __name__ == "__main__":
    main()
