"""Runs in the trackers people already watch: ``run.log_to: [tensorboard, mlflow]``.

Each evaluation (accuracy, loss, bytes down/up/total, virtual time, at the aggregation count as
the step) goes to TensorBoard event files and/or an MLflow run as it happens, next to
``evaluations.csv``; the final summary follows when the run ends. One tracker run per felix run,
so ``felix compare`` and ``felix sweep`` give one per variant and seed, named by its key
(``felix/seed=0``), with the flattened config as its parameters.

- TensorBoard: event files in ``<run folder>/tensorboard`` (the extra felix-fl[tracking], or any
  ``tensorboard`` install); ``tensorboard --logdir runs/`` shows every run below. An
  evaluation's TensorBoard wall time is its *virtual* time (seconds from the run's start), so
  TensorBoard's "relative" horizontal axis is felix's virtual clock.
- MLflow: a SQLite store, ``<run folder>/mlflow.db`` (artifacts in ``<run folder>/mlartifacts``),
  by default: no server and no network, and the store MLflow itself recommends, so that
  ``mlflow ui --backend-store-uri sqlite:///<run folder>/mlflow.db`` opens it as it is.
  ``run.mlflow_uri`` names any other store (an absolute ``sqlite:////...`` URI to gather a
  comparison's runs in one place, a tracking server the user runs); ``run.mlflow_experiment`` the
  experiment (default: the config's ``name``). MLflow's usage telemetry is switched off in code,
  before mlflow is imported.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from felix.config import Config, ConfigError
from felix.metrics.recorder import EvalRow

TRACKERS = ("tensorboard", "mlflow")
#: Set before mlflow is imported: no usage telemetry.
MLFLOW_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}
#: The default store and artifact folder, under the run's folder.
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlartifacts"
EVAL_METRICS = ("accuracy", "loss", "bytes_total", "bytes_down", "bytes_up", "virtual_time_s")


class Tracker(Protocol):
    def log_eval(self, row: EvalRow) -> None: ...

    def finish(self, summary: Mapping[str, Any]) -> None: ...


def eval_metrics(row: EvalRow) -> dict[str, float]:
    """One evaluation's values under their tracker names."""
    return {
        "accuracy": float(row.accuracy),
        "loss": float(row.loss),
        "bytes_total": float(row.bytes_total),
        "bytes_down": float(row.bytes_down),
        "bytes_up": float(row.bytes_up),
        "virtual_time_s": float(row.time_s),
    }


def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's numbers (top level; booleans and None left out), for the trackers' scalars."""
    return {
        k: float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def flat_params(cfg: Config) -> dict[str, str]:
    """The config as ``section.key -> value`` strings (the trackers' run parameters)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(value)

    walk("", cfg.model_dump(mode="json"))
    return out


class TensorBoardTracker:
    """Scalars ``eval/<metric>`` per evaluation (step: the aggregation count) and
    ``summary/<key>`` at the end; the config and the summary as text."""

    def __init__(self, folder: Path, params: Mapping[str, str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                'run.log_to tensorboard needs TensorBoard: pip install "felix-fl[tracking]"'
            ) from None
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))
        self._start = time.time()
        self._last_step = 0
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def log_eval(self, row: EvalRow) -> None:
        # Wall time = the run's start + the virtual time: TensorBoard's relative axis is virtual time.
        when = self._start + float(row.time_s)
        for name, value in eval_metrics(row).items():
            self.writer.add_scalar(f"eval/{name}", value, row.version, walltime=when)
        self._last_step = row.version

    def finish(self, summary: Mapping[str, Any]) -> None:
        for name, value in summary_metrics(summary).items():
            self.writer.add_scalar(f"summary/{name}", value, self._last_step)
        self.writer.add_text("stop_reason", str(summary.get("stop_reason")), self._last_step)
        self.writer.close()


class MlflowTracker:
    """One MLflow run: the config as parameters, ``<metric>`` per evaluation (step: the
    aggregation count; timestamp: the virtual time in ms), ``final.<key>`` and ``summary.json``
    (an artifact) at the end; the run ends FINISHED, or KILLED when interrupted."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, str],
        artifacts: Path | None = None,
    ) -> None:
        os.environ.update(MLFLOW_ENV)
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Param
        except ImportError:
            raise ConfigError('run.log_to mlflow needs MLflow: pip install "felix-fl[tracking]"') from None
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        # A new experiment keeps its artifacts in ``artifacts`` (the run folder's), not in MLflow's
        # default ./mlruns under whatever the working directory is.
        where = None if artifacts is None else artifacts.resolve().as_uri()
        exp_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(experiment, artifact_location=where)
        )
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self._step = 0
        items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
        for at in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[at : at + 100])

    def log_eval(self, row: EvalRow) -> None:
        self._metrics(eval_metrics(row), step=row.version, at_ms=int(1000 * row.time_s))
        self._step = row.version

    def _metrics(self, values: Mapping[str, float], step: int, at_ms: int) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, at_ms, step) for k, v in values.items()])

    def finish(self, summary: Mapping[str, Any]) -> None:
        self._metrics({f"final.{k}": v for k, v in summary_metrics(summary).items()}, self._step, 0)
        self.client.log_dict(self.run_id, dict(summary), "summary.json")
        status = "KILLED" if summary.get("stop_reason") == "interrupted" else "FINISHED"
        self.client.set_terminated(self.run_id, status=status)


def make_trackers(cfg: Config, folder: Path | None, run_name: str) -> list[Tracker]:
    """The trackers ``run.log_to`` names, writing under the run's ``folder`` (None: no folder, as
    for ``felix.api.run`` without ``out_dir``, which is an error unless MLflow has a URI)."""
    r = cfg.run
    out: list[Tracker] = []
    params = flat_params(cfg) if r.log_to else {}
    for name in r.log_to:
        if name == "tensorboard":
            if folder is None:
                raise ConfigError(
                    "run.log_to tensorboard writes under the run's folder: give the run an out_dir"
                )
            out.append(TensorBoardTracker(folder / "tensorboard", params))
        else:
            uri, artifacts = r.mlflow_uri, None
            if uri is None:
                if folder is None:
                    raise ConfigError(
                        f"run.log_to mlflow: give the run an out_dir (its store is <out_dir>/{MLFLOW_DB}) "
                        "or set run.mlflow_uri"
                    )
                folder.mkdir(parents=True, exist_ok=True)
                uri, artifacts = f"sqlite:///{(folder / MLFLOW_DB).resolve()}", folder / MLFLOW_ARTIFACTS
            out.append(MlflowTracker(uri, r.mlflow_experiment or cfg.name, run_name, params, artifacts))
    return out


class TrackedSink:
    """The run controller's evaluation sink (``evaluations.csv``) with trackers alongside."""

    def __init__(self, inner: Any, trackers: Iterable[Tracker]) -> None:
        self.inner = inner
        self.trackers = list(trackers)

    def reset(self, rows: list[EvalRow]) -> None:
        if self.inner is not None:
            self.inner.reset(rows)
        for row in rows:  # a resumed run's restored evaluations
            self.append_trackers(row)

    def append(self, row: EvalRow) -> None:
        if self.inner is not None:
            self.inner.append(row)
        self.append_trackers(row)

    def append_trackers(self, row: EvalRow) -> None:
        for t in self.trackers:
            t.log_eval(row)

    def finish(self, summary: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.finish(summary)


__all__ = [
    "EVAL_METRICS",
    "TRACKERS",
    "MlflowTracker",
    "TensorBoardTracker",
    "TrackedSink",
    "Tracker",
    "flat_params",
    "make_trackers",
]
