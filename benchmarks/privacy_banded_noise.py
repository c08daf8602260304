"""The noise banded matrix factorisation (``banded_mf``) adds against tree aggregation
(``dp_ftrl``) at the same epsilon, by the runs' own accounting.

For each epsilon, each mechanism's noise multiplier is the smallest (bisection, to a relative
1e-4) at which ``steps`` aggregations stay within it (``felix.privacy.accountant.Accountant``,
clients capped at ``max_participations``; under ``banded_mf`` also at ceil(steps / b) by the
separation rule). Then, in units of the clip norm C on one aggregation's sum (divide by K for the
applied mean), exactly from the factorisation (no sampling):

- increment: the std of the noise on each aggregation's step (tree: the nodes that enter or leave
  between consecutive prefixes; banded: sigma ||row t of C^-1||), root mean square over the run;
- prefix: the std of the noise on the running sum, i.e. on the model under the plain server step
  (tree: sigma sqrt(popcount t); banded: sigma ||row t of B||), root mean square over the run and
  at its last aggregation.

    python benchmarks/privacy_banded_noise.py --out docs/results/privacy/banded_mf_noise.json
"""

from __future__ import annotations

import argparse
import json
import math
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from felix.metrics.provenance import provenance
from felix.privacy.accountant import Accountant
from felix.privacy.banded import (
    inverse_coefficients,
    participations,
    prefix_coefficients,
    sqrt_coefficients,
    toeplitz,
)
from felix.privacy.tree import nodes_of


def calibrate(epsilon: float, steps: int, acc: Accountant) -> float:
    """The smallest noise multiplier (to a relative 1e-4) whose ``steps`` aggregations stay within
    ``epsilon`` (epsilon falls as the noise grows)."""
    lo, hi = 1e-3, 1e4
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if acc.with_noise(mid).epsilon_after(steps) <= epsilon else (mid, hi)
    return hi


def tree_noise(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per unit sigma: the std of each step's noise and of each prefix's, t = 1..steps."""
    inc, pre = [], []
    for t in range(1, steps + 1):
        now, before = set(nodes_of(t)), set(nodes_of(t - 1))
        inc.append(math.sqrt(len(now ^ before)))  # a node in both cancels in the difference
        pre.append(math.sqrt(len(now)))
    return np.array(inc), np.array(pre)


def banded_noise(bands: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    c = sqrt_coefficients(bands)
    inc = np.linalg.norm(toeplitz(inverse_coefficients(c, steps), steps), axis=1)
    pre = np.linalg.norm(toeplitz(prefix_coefficients(c, steps), steps), axis=1)
    return inc, pre


def rms(v: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(v))))


def row(name: str, sigma: float, k: int, inc: np.ndarray, pre: np.ndarray) -> dict[str, Any]:
    return {
        "mechanism": name,
        "noise_multiplier": round(sigma, 4),
        "participations": k,
        "increment_std_rms": round(sigma * rms(inc), 4),
        "prefix_std_rms": round(sigma * rms(pre), 4),
        "prefix_std_last": round(sigma * float(pre[-1]), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=127, help="aggregations in the run")
    ap.add_argument("--max-participations", type=int, default=5)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--bands", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 127])
    ap.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    cap, steps = a.max_participations, a.steps
    t_inc, t_pre = tree_noise(steps)
    results = []
    for eps in a.epsilons:
        tree = Accountant("dp_ftrl", 1.0, a.delta, kind=a.accountant, max_participations=cap)
        rows = [row("dp_ftrl", calibrate(eps, steps, tree), min(cap, steps), t_inc, t_pre)]
        for b in a.bands:
            acc = Accountant("banded_mf", 1.0, a.delta, kind=a.accountant, max_participations=cap, bands=b)
            inc, pre = banded_noise(b, steps)
            rows.append(
                row(f"banded_mf b={b}", calibrate(eps, steps, acc), participations(steps, b, cap), inc, pre)
            )
        results.append({"epsilon": eps, "rows": rows})
        for r in rows:
            print(eps, *r.values())
    doc = {
        "what": "noise std in units of the clip norm on one aggregation's sum (divide by K for the mean)",
        "steps": steps,
        "max_participations": cap,
        "delta": a.delta,
        "accountant": a.accountant,
        "results": results,
        "provenance": {
            **provenance(),
            "dp_accounting": version("dp-accounting"),
            "command": f"python benchmarks/privacy_banded_noise.py --out {a.out}",
        },
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
