"""Wall time of ``felix plan-augmentation`` against the library call it wraps, side by side.

Run: ``PYTHONPATH=src python benchmarks/dafl_cli.py [--repeats R] [--out FILE.json]``

Cases: Table II's D1-D6 at lambda2 = 1e2 (the paper's partitions, 8 x 8), and a Dirichlet-skewed
5,000 x 100 table (``dafl_planner.skewed_counts``, seed 0, 2.6 million samples) at step 1, where
the CLI's default time budget refuses it and names a step, at the step it names, and at step 100.

Per case and repeat, in this one process: the CLI as a fresh ``python -m felix plan-augmentation
COUNTS.csv --json`` (wall seconds from spawn to exit: interpreter, imports, loading the compiled
kernel, reading the CSV, planning, printing), the library in a fresh process (``python -c`` that
imports ``felix.strategies.dataplans.dafl`` and calls ``plan_dafl`` on the same matrix: the same
work without the CLI), and ``plan_dafl`` in this warm process (the kernel already loaded); the
library calls get the CLI's default time budget (60 s), so all three do the same work. Reports the
minimum and median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dafl_planner import skewed_counts

from felix.metrics.provenance import git_commit
from felix.strategies.dataplans.dafl import DaflParams, PlanTooLargeError, plan_dafl
from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition

LIBRARY_PROBE = (
    "import sys, numpy as np\n"
    "from felix.strategies.dataplans.dafl import DaflParams, plan_dafl\n"
    "counts = np.load(sys.argv[1])\n"
    "try:\n"
    "    print(plan_dafl(counts, DaflParams(step=int(sys.argv[2])), time_budget_s=60.0).added)\n"
    "except ValueError as exc:\n"
    "    print('refused:', exc)\n"
)


def write_csv(path: Path, counts: NDArray[np.int64]) -> None:
    """COUNTS.csv with a declared client id column."""
    lines = ["client," + ",".join(f"c{j}" for j in range(counts.shape[1]))]
    lines += [f"k{k}," + ",".join(map(str, row)) for k, row in enumerate(counts.tolist())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=900)
    return time.perf_counter() - start, done


def summary(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4)}


def run_case(
    name: str, counts: NDArray[np.int64], step: int, folder: Path, repeats: int, env: dict[str, str]
) -> dict[str, Any]:
    csv_path, npy_path = folder / f"{name}.csv", folder / f"{name}.npy"
    write_csv(csv_path, counts)
    np.save(npy_path, counts)
    cli, cold, warm = [], [], []
    outcome = ""
    for _ in range(repeats):
        seconds, done = timed(
            [
                sys.executable,
                "-m",
                "felix",
                "plan-augmentation",
                str(csv_path),
                "--json",
                "--step",
                str(step),
            ],
            env,
        )
        cli.append(seconds)
        outcome = (
            f"added {json.loads(done.stdout)['added']}"
            if done.returncode == 0
            else done.stderr.strip().splitlines()[-1]
        )
        seconds, done = timed([sys.executable, "-c", LIBRARY_PROBE, str(npy_path), str(step)], env)
        cold.append(seconds)
        start = time.perf_counter()
        try:
            plan_dafl(counts, DaflParams(step=step), time_budget_s=60.0)
        except PlanTooLargeError:
            pass
        warm.append(time.perf_counter() - start)
    row = {
        "case": name,
        "shape": list(counts.shape),
        "step": step,
        "cli_wall_s": summary(cli),
        "library_fresh_process_wall_s": summary(cold),
        "library_in_process_wall_s": summary(warm),
        "cli_outcome": outcome,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true", help="only Table II's cases")
    parser.add_argument("--out", help="write the rows and provenance here as one JSON object")
    args = parser.parse_args()
    env = {**os.environ}
    git = git_commit()  # the code that runs, read before it runs
    plan_dafl(partition("D1"), DaflParams())  # load the kernel in this process
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in DATASET_NAMES:
            rows.append(run_case(name, partition(name), 1, folder, args.repeats, env))
        if not args.skip_large:
            large = skewed_counts(5000, 100, 0)
            refused = run_case("skewed-5000x100", large, 1, folder, args.repeats, env)
            rows.append(refused)
            suggested = re.search(r"use a step of at least (\d+) samples", refused["cli_outcome"])
            steps = [int(suggested.group(1))] if suggested else []
            for step in [*steps, 100]:
                rows.append(run_case("skewed-5000x100", large, step, folder, args.repeats, env))
    if args.out:
        result = {
            "benchmark": "dafl_cli",
            "command": "PYTHONPATH=src nice -n 10 python benchmarks/dafl_cli.py "
            f"--repeats {args.repeats} --out {Path(args.out).name}",
            "rows": rows,
            "provenance": {
                "git": git,
                "python": sys.version.split()[0],
                "numpy": np.__version__,
                "numba": __import__("numba").__version__,
                "cpus": os.cpu_count(),
                "load_average_at_end": os.getloadavg(),
            },
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
