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

ENDLESS = [
    "--set",
    "partition.num_clients=12",
    "--set",
    "model=mlp",
    "--set",
    "run.stop_at_target=false",
    "--set",
    "run.max_aggregations=100000",
    "--set",
    "run.max_time_s=1e9",
    "--set",
    "orchestrator.concurrency=4",
    "--set",
    "orchestrator.agg_goal=2",
]


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def _felix(args: list[str]) -> subprocess.Popen[bytes]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "felix", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def _signal_after_evaluations(proc: subprocess.Popen[bytes], csv_path: Path, sig: signal.Signals) -> bytes:
    """Wait (bounded) until the run has written three evaluations, signal it, return its stderr."""
    try:
        deadline = time.monotonic() + 90
        while len(_rows(csv_path)) < 3:  # live: rows appear as the evaluations happen
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no three evaluations within 90 s"
            time.sleep(0.1)
        assert not (csv_path.parent / "summary.json").exists()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return err


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["SIGINT", "SIGTERM"]
)
def test_interrupted_run_leaves_its_summary_and_evaluations(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "run"
    proc = _felix(["run", "-q", *ENDLESS, "--out", str(out)])
    err = _signal_after_evaluations(proc, out / "evaluations.csv", sig)
    assert proc.returncode == 130, err.decode()[-2000:]
    summ = json.loads((out / "summary.json").read_text())
    assert summ["stop_reason"] == "interrupted"
    rows = _rows(out / "evaluations.csv")
    assert len(rows) >= 3 and len(rows) == summ["evaluations"]
    assert int(rows[-1]["version"]) == summ["aggregations"]  # the model it stopped at was evaluated
    assert summ["bytes_down"] > 0 and summ["updates_applied"] > 0


@pytest.mark.slow
def test_interrupted_compare_keeps_the_run_and_starts_no_other(tmp_path: Path) -> None:
    """SIGTERM during the first run of ``felix compare``: that run ends ``interrupted`` with its
    evaluations, the next one never starts, and the command says so (exit 130)."""
    proc = _felix(["compare", "--strategies", "fedbuff,felix", *ENDLESS, "--out", str(tmp_path)])
    err = _signal_after_evaluations(proc, tmp_path / "fedbuff" / "evaluations.csv", signal.SIGTERM)
    assert proc.returncode == 130, err.decode()[-2000:]
    summ = json.loads((tmp_path / "fedbuff" / "summary.json").read_text())
    assert (
        summ["stop_reason"] == "interrupted"
        and summ["evaluations"] == len(_rows(tmp_path / "fedbuff" / "evaluations.csv")) >= 3
    )
    assert not (tmp_path / "felix").exists() and b"felix not started" in err


def test_ctrl_c_in_compare_exits_130_and_the_table_says_interrupted(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) during the first of two variants: exit 130 as ``felix run``, and
    comparison.md and manifest.json call the stopped variant and the one never started
    "interrupted", not "not reached"."""
    proc = _felix(["compare", "--strategies", "fedbuff,felix", *ENDLESS, "--out", str(tmp_path)])
    err = _signal_after_evaluations(proc, tmp_path / "fedbuff" / "evaluations.csv", signal.SIGINT)
    assert proc.returncode == 130, err.decode()[-2000:]
    md = (tmp_path / "comparison.md").read_text()
    assert "| fedbuff (interrupted) | interrupted (0/1 reached) |" in md, md
    assert "Interrupted (Ctrl-C or SIGTERM; the next `felix compare` reruns them): fedbuff, felix" in md
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {k: r["status"] for k, r in manifest["runs"].items()} == {
        "fedbuff": "interrupted",
        "felix": "interrupted",
    }
