"""Stopping is safe: a ``felix run`` interrupted mid-way by Ctrl-C (SIGINT) or SIGTERM ends with
summary.json marked ``interrupted`` and the evaluations it made (bounded in time)."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENDLESS = ["--set", "partition.num_clients=12", "--set", "model=mlp", "--set", "run.stop_at_target=false",
           "--set", "run.max_aggregations=100000", "--set", "run.max_time_s=1e9",
           "--set", "orchestrator.concurrency=4", "--set", "orchestrator.agg_goal=2"]


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_leaves_its_summary_and_evaluations(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "run"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "felix", "run", "-q", *ENDLESS, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 90
        while len(_rows(out / "evaluations.csv")) < 3:  # live: rows appear as the evaluations happen
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no three evaluations within 90 s"
            time.sleep(0.1)
        assert not (out / "summary.json").exists()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err.decode()[-2000:]
    summ = json.loads((out / "summary.json").read_text())
    assert summ["stop_reason"] == "interrupted"
    rows = _rows(out / "evaluations.csv")
    assert len(rows) >= 3 and len(rows) == summ["evaluations"]
    assert int(rows[-1]["version"]) == summ["aggregations"]  # the model it stopped at was evaluated
    assert summ["bytes_down"] > 0 and summ["updates_applied"] > 0
