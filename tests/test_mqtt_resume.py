"""Checkpoint and resume over a real broker: the server is killed (SIGKILL) after a few versions,
``felix serve --resume`` restores the last checkpoint, the broker redelivers what the dead server
had not acknowledged, and the run completes with no update applied twice."""

from __future__ import annotations

import csv
import json
import math
import signal
from pathlib import Path

import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    start_clients,
    users,
    wait_until,
    write_config,
)

from felix.deploy import checkpoint as ckpt

pytestmark = needs_mosquitto
SCALE = 0.03


STREAM = {
    "enabled": True,
    "arrivals": {"rate_per_hour": 3600, "warmup_s": 20.0, "rate_spread": 0.0},
    "labels": {"delay": "constant", "median_s": 5.0},
    "store": {"cap": 400},
}


@pytest.mark.parametrize(
    "stream", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fixed-data", "stream"]
)
def test_kill_and_resume_applies_every_update_once(tmp_path: Path, stream: bool) -> None:
    """On a stream the resumed server also keeps its freshness curve: the evaluations of the
    killed life stay in it."""
    cfg_path = write_config(
        tmp_path / "cfg.yaml",
        partition={"num_clients": 12},
        trace={"kind": "always"},
        **({"stream": STREAM} if stream else {}),
    )
    sets = ["--set", "orchestrator.agg_goal=3", "--set", "orchestrator.concurrency=6"]
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 3, "concurrency": 6}})
    out, ck = tmp_path / "out", tmp_path / "ck.safetensors"
    with MosquittoBroker(12, workdir=tmp_path / "broker") as broker:
        env_pw = users(broker)["felix-server"]
        args = [
            "serve",
            str(cfg_path),
            *sets,
            "--broker",
            broker.address,
            "--run-id",
            "t",
            f"--password={env_pw}",
            "--time-scale",
            str(SCALE),
            "--out",
            str(out),
            "--checkpoint",
            str(ck),
        ]
        first = spawn(args, tmp_path / "life0.log")
        resumed = None
        host, clients = start_clients(cfg, broker, list(range(12)), SCALE)
        try:

            def checkpointed_version() -> int:
                try:
                    return _version(ck)
                except (ckpt.CheckpointError, OSError):
                    return -1

            wait_until(lambda: checkpointed_version() >= 3, 60, "a checkpoint at version 3")
            first.send_signal(signal.SIGKILL)  # no final checkpoint, no acks: a crash
            reap(first)
            killed_at = checkpointed_version()
            resumed = spawn([*args, "--resume"], tmp_path / "life1.log")
            assert reap(resumed, timeout=60) == [0], (tmp_path / "life1.log").read_text()[-3000:]
            clients.result(20)  # the clients stop when the resumed server announces the end
        finally:
            host.stop_requested.set()
            reap(*[p for p in (first, resumed) if p is not None])
    summ = json.loads((out / "summary.json").read_text())
    assert summ["stop_reason"] == "target_reached" and summ["deployment"]["lives"] == 2
    assert summ["aggregations"] > killed_at
    with open(out / "applied_updates.csv") as f:
        applied = list(csv.DictReader(f))
    task_ids = [int(r["task_id"]) for r in applied]
    assert len(task_ids) == len(set(task_ids)) == summ["updates_applied"], "an update was applied twice"
    versions = [int(r["version"]) for r in applied]
    assert versions == sorted(versions) and set(versions) == set(range(1, summ["aggregations"] + 1))
    # Tasks of the resumed life are numbered in a fresh range, so no stale result can match them.
    assert any(t > ckpt.RESUME_TASK_ID_STRIDE for t in task_ids)
    with open(out / "evaluations.csv") as f:
        evals = [int(r["version"]) for r in csv.DictReader(f)]
    assert evals == sorted(set(evals)), "each version is evaluated once, across both lives"
    assert summ["transport"]["re_registrations"] >= 12  # every client registered again with the new session
    assert "resumed from" in (tmp_path / "life1.log").read_text()
    if stream:
        # The curve starts at the first evaluation of the killed life, not of the resumed one.
        with open(out / "evaluations.csv") as f:
            first_eval = min(float(r["time_s"]) for r in csv.DictReader(f))
        with open(out / "freshness.csv") as f:
            curve = [(float(r["time_s"]), float(r["accuracy"])) for r in csv.DictReader(f)]
        assert min(t for t, a in curve if not math.isnan(a)) == first_eval
        assert summ["stream"]["time_avg_accuracy"] is not None


def _version(path: Path) -> int:
    return int(ckpt.load_checkpoint(path)["orchestrator"]["version"])
