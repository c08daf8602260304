"""One simulated run from a config: build (``felix.sim.build``), run, summarise, write outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError
from felix.engine.interrupt import stop_on_signals
from felix.metrics.recorder import EvalRow
from felix.metrics.report import EvalLog, make_output_dir, rejections_by_kind, rejections_by_reason
from felix.sim.build import Built, build
from felix.strategies.dataplans.plans import plan_summary
from felix.stream.summary import stream_summary


@dataclass
class RunResult:
    summary: dict[str, Any]
    rows: list[EvalRow]
    built: Built


def run_config(
    cfg: Config,
    out_dir: Path | None = None,
    progress: bool = False,
    plots: bool = True,
    prepare: Callable[[Built], None] | None = None,
    interruptible: bool = False,
    live_dir: Path | None = None,
    run_name: str | None = None,
    **objects: Any,
) -> RunResult:
    """Build and simulate ``cfg``; ``prepare`` may instrument the built run (e.g. wrap its
    evaluator) before it starts. The evaluations are appended to ``live_dir`` (default ``out_dir``)
    /evaluations.csv as they happen. ``interruptible`` (the CLI's runs): SIGINT and SIGTERM end the
    run after the event in hand, with ``stop_reason: interrupted`` and all it measured.
    ``objects``: ``population``, ``model``, ``trace`` for ``felix.sim.build.build`` (the Python
    API, felix.api). ``run.log_to`` trackers write under the same folder, as one tracker run named
    ``run_name`` (default: the folder's name)."""
    for folder in (out_dir, live_dir):
        if folder is not None:
            make_output_dir(folder)
    built = build(cfg, **objects)
    cfg = built.cfg  # a prepared population sets partition.num_clients
    if prepare is not None:
        prepare(built)
    if progress:
        built.sim.cfg = type(built.sim.cfg)(**{**built.sim.cfg.__dict__, "progress": True})
    ctl = built.controller
    assert ctl is not None
    live = live_dir or out_dir
    if live is not None:
        # evaluations land on disk as they happen
        ctl.sink = EvalLog(live / "evaluations.csv", epsilon=cfg.privacy.enabled)
    tracked = None
    if cfg.run.log_to:
        from felix.metrics.tracking import TrackedSink, make_trackers

        name = run_name or (live.name if live is not None else cfg.name)
        ctl.sink = tracked = TrackedSink(ctl.sink, make_trackers(cfg, live, name))
    with stop_on_signals(ctl.request_stop, enabled=interruptible):
        outcome = built.sim.run()
    summ = ctl.summary(
        outcome.virtual_time_s,
        outcome.wall_time_s,
        {
            **plan_summary(built.data_plan),
            "rejected_by_reason": rejections_by_reason(r.reason for r in outcome.rejected),
            "rejected_by_kind": rejections_by_kind(r.kind for r in outcome.rejected),
            **stream_summary(built, outcome.virtual_time_s),
        },
    )
    if tracked is not None:
        tracked.finish(summ)
    if out_dir is not None:
        ctl.write_outputs(out_dir, summ, plots)
    if live is not None and built.freshness is not None:  # a comparison's runs write it too
        built.freshness.write(live, outcome.virtual_time_s, plots)
    return RunResult(summ, built.recorder.rows, built)


__all__ = ["ConfigError", "RunResult", "run_config"]
