"""``run.log_to: [tensorboard, mlflow]``: each evaluation and the final summary reach TensorBoard
event files and an MLflow run (a SQLite store under the run folder), one tracker run per
compare variant and seed, with the config as parameters; read back here from the files, and by the
installed MLflow's own command line as the README documents it.

Skipped without the extra: ``pip install "felix-fl[tracking]"``.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard", reason='needs TensorBoard: pip install "felix-fl[tracking]"')
pytest.importorskip("mlflow", reason='needs MLflow: pip install "felix-fl[tracking]"')

from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from felix.cli import main
from felix.config import ConfigError
from felix.engine.setup import resolve_config
from felix.sim.run import run_config

#: Every address this process connects a socket to (the audit hook stays for the process).
CONNECTS: list[Any] = []
sys.addaudithook(lambda event, args: CONNECTS.append(args[1]) if event == "socket.connect" else None)

SMALL = [
    "--set=partition.num_clients=20",
    "--set=orchestrator.agg_goal=4",
    "--set=orchestrator.concurrency=6",
    "--set=run.max_aggregations=5",
    "--set=run.stop_at_target=false",
]


def _evaluations(folder: Path) -> list[dict[str, str]]:
    with open(folder / "evaluations.csv", newline="") as f:
        return list(csv.DictReader(f))


def _sqlite(db: Path) -> str:
    return f"sqlite:///{db.resolve()}"


def _mlflow_runs(uri: str) -> list[Any]:
    client = MlflowClient(tracking_uri=uri)
    exps = client.search_experiments()
    return client.search_runs([e.experiment_id for e in exps])


def test_run_logs_every_evaluation_and_the_summary_to_tensorboard_and_mlflow(tmp_path: Path) -> None:
    out = tmp_path / "run"
    CONNECTS.clear()
    rc = main(["run", "-q", "--out", str(out), "--set=run.log_to=[tensorboard, mlflow]", *SMALL])
    assert rc == 0
    assert not CONNECTS, CONNECTS  # local files only: no socket at all
    rows = _evaluations(out)
    summary = json.loads((out / "summary.json").read_text())
    assert len(rows) == 6

    # TensorBoard: one scalar per evaluation, at the aggregation count, with the virtual time.
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tb_acc = acc.Scalars("eval/accuracy")
    assert [e.step for e in tb_acc] == [int(r["version"]) for r in rows]
    assert [e.value for e in tb_acc] == pytest.approx([float(r["accuracy"]) for r in rows], abs=1e-6)
    tb_bytes = [e.value for e in acc.Scalars("eval/bytes_total")]
    assert tb_bytes == pytest.approx([float(r["bytes_total"]) for r in rows], rel=1e-6)
    tb_time = [e.value for e in acc.Scalars("eval/virtual_time_s")]
    assert tb_time == pytest.approx([float(r["time_s"]) for r in rows], abs=1e-3)
    assert acc.Scalars("summary/final_accuracy")[0].value == pytest.approx(summary["final_accuracy"])
    assert acc.Scalars("summary/aggregations")[0].value == 5

    # MLflow: one run in the run folder's SQLite store, the config as parameters.
    (run,) = _mlflow_runs(_sqlite(out / "mlflow.db"))
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    assert run.data.params["strategy"] == "fedbuff"
    assert run.data.params["partition.num_clients"] == "20"
    client = MlflowClient(tracking_uri=_sqlite(out / "mlflow.db"))
    hist = client.get_metric_history(run.info.run_id, "accuracy")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [int(r["version"]) for r in rows]
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx(
        [float(r["accuracy"]) for r in rows]
    )
    assert run.data.metrics["final.final_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert run.data.metrics["final.bytes_up"] == summary["bytes_up"]
    assert run.info.artifact_uri.startswith((out / "mlartifacts").resolve().as_uri())
    logged = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(logged.read_text())["aggregations"] == 5


def test_compare_gives_one_tracker_run_per_variant_and_seed(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a store named by run.mlflow_uri keeps new artifacts under ./mlruns
    out = tmp_path / "cmp"
    store = _sqlite(tmp_path / "store.db")
    rc = main(
        [
            "compare",
            "--strategies",
            "fedavg,fedbuff",
            "--seeds",
            "0",
            "1",
            "--out",
            str(out),
            "--set=run.log_to=[mlflow, tensorboard]",
            f"--set=run.mlflow_uri={store}",
            "--set=run.mlflow_experiment=cmp",
            *SMALL,
        ]
    )
    assert rc == 0
    runs = _mlflow_runs(store)
    assert sorted(r.info.run_name for r in runs) == [
        "fedavg/seed=0",
        "fedavg/seed=1",
        "fedbuff/seed=0",
        "fedbuff/seed=1",
    ]
    assert {r.data.params["seed"] for r in runs} == {"0", "1"}
    # The finished runs are read back, not refused, when only the trackers change.
    again = ["compare", "--strategies", "fedavg,fedbuff", "--seeds", "0", "1", "--out", str(out), *SMALL]
    assert main(again) == 0
    assert "finished run of a different config" not in capsys.readouterr().err
    events = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("**/tensorboard/events.*"))
    assert events == [
        "fedavg/seed-0/tensorboard",
        "fedavg/seed-1/tensorboard",
        "fedbuff/seed-0/tensorboard",
        "fedbuff/seed-1/tensorboard",
    ]


def test_tracking_without_a_folder_is_a_clear_error() -> None:
    cfg = resolve_config(None, None, {"run": {"log_to": ["tensorboard"], "max_aggregations": 1}})
    with pytest.raises(ConfigError, match="out_dir"):
        run_config(cfg, None, plots=False)
    with pytest.raises(ConfigError, match="log_to"):
        resolve_config(None, None, {"run": {"log_to": ["wandb"]}})


README = Path(__file__).resolve().parents[1] / "README.md"
#: The README's tracking example, run here as written (the MLflow UI only in the slow test).
FELIX_TRACKED = "felix run --set 'run.log_to=[mlflow]' --set run.max_aggregations=20 --out runs/tracked"
MLFLOW_UI = "mlflow ui --backend-store-uri sqlite:///runs/tracked/mlflow.db"


def _documented_run(cwd: Path) -> None:
    """The README's ``felix run`` line, verbatim, in ``cwd``."""
    assert FELIX_TRACKED in README.read_text() and MLFLOW_UI in README.read_text()
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "felix", *shlex.split(FELIX_TRACKED)[1:], "-q"]
    done = subprocess.run(argv, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_the_installed_mlflow_command_line_reads_the_default_store(tmp_path: Path) -> None:
    """MLflow's own CLI (no server) reads the experiment from ``sqlite:///runs/tracked/mlflow.db``,
    the store the README opens with ``mlflow ui`` (a file store fails there: MLflow 3 refuses it).
    The runs inside are read in process above (the default suite); the UI serving them is below."""
    _documented_run(tmp_path)
    env = {**os.environ, "MLFLOW_TRACKING_URI": MLFLOW_UI.split()[-1], "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    mlflow = [sys.executable, "-m", "mlflow"]
    exps = subprocess.run(
        [*mlflow, "experiments", "search"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exps.returncode == 0 and "digits-churn90" in exps.stdout, exps.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_documented_mlflow_ui_command_serves_the_run(tmp_path: Path) -> None:
    """The README's ``mlflow ui`` line as written (plus a free ``--port``; it listens on 127.0.0.1)
    serves the run's experiment and metrics over loopback within a bounded time."""
    _documented_run(tmp_path)
    port = _free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    argv = [sys.executable, "-m", "mlflow", *shlex.split(MLFLOW_UI)[1:], "--port", str(port)]
    ui = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}/api/2.0/mlflow"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert ui.poll() is None, ui.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "mlflow ui did not answer within 240 s"
            try:
                with urllib.request.urlopen(f"{base}/experiments/search?max_results=10", timeout=5) as r:
                    exps = json.load(r)["experiments"]
                break
            except OSError:
                time.sleep(1)
        (exp,) = [e for e in exps if e["name"] == "digits-churn90"]
        query = json.dumps({"experiment_ids": [exp["experiment_id"]]}).encode()
        req = urllib.request.Request(
            f"{base}/runs/search", data=query, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            (run,) = json.load(r)["runs"]
        assert run["info"]["run_name"] == "tracked" and run["info"]["status"] == "FINISHED"
        assert {m["key"] for m in run["data"]["metrics"]} >= {"accuracy", "final.aggregations"}
    finally:
        os.killpg(ui.pid, signal.SIGTERM)  # the UI and the workers it started
        try:
            ui.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait(10)
