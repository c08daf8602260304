"""``run.log_to: [tensorboard, mlflow]``: each evaluation and the final summary reach TensorBoard
event files and an MLflow run (a local file store under the run folder), one tracker run per
compare variant and seed, with the config as parameters; read back here from the files.

Skipped without the extra: ``pip install "felix-fl[tracking]"``.
"""

from __future__ import annotations

import csv
import json
import sys
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


def _mlflow_runs(store: Path) -> list[Any]:
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
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

    # MLflow: one run in the run folder's file store, the config as parameters.
    (run,) = _mlflow_runs(out / "mlruns")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    assert run.data.params["strategy"] == "fedbuff"
    assert run.data.params["partition.num_clients"] == "20"
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    hist = client.get_metric_history(run.info.run_id, "accuracy")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [int(r["version"]) for r in rows]
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == pytest.approx(
        [float(r["accuracy"]) for r in rows]
    )
    assert run.data.metrics["final.final_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert run.data.metrics["final.bytes_up"] == summary["bytes_up"]
    logged = Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path)))
    assert json.loads(logged.read_text())["aggregations"] == 5


def test_compare_gives_one_tracker_run_per_variant_and_seed(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "cmp"
    store = tmp_path / "store"
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
            f"--set=run.mlflow_uri={store.resolve().as_uri()}",
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
