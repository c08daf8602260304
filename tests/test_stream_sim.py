"""Streams in the simulator: a task trains on the labelled samples present at its start (never a
sample before its label time), updates carry the arrival span of their data, and the summary
reports freshness."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from felix.config import ConfigError
from felix.engine.setup import resolve_config
from felix.sim.build import Built
from felix.sim.run import run_config

STREAM = {
    "stream.enabled": True,
    "stream.arrivals.rate_per_hour": 40,
    "stream.arrivals.warmup_s": 1200,
    "stream.labels.delay": "lognormal",
    "stream.labels.median_s": 300,
    "stream.store.cap": 60,
    "stream.drift.shifts": [{"kind": "surge", "at_s": 900, "classes": [3, 8], "factor": 10}],
}
SMALL = {
    "model": "mlp",
    "partition.num_clients": 20,
    "orchestrator.concurrency": 6,
    "orchestrator.agg_goal": 3,
    "run.max_time_s": 1800,
    "run.stop_at_target": False,
}


def nested(flat: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})  # type: ignore[assignment]
        node[last] = value
    return out


def test_a_stream_run_trains_only_on_labelled_samples_present_at_task_start(tmp_path: Path) -> None:
    cfg = resolve_config(None, "fedbuff", nested({**SMALL, **STREAM}))
    seen: list[tuple[float, np.ndarray, np.ndarray, int]] = []
    spans: list[tuple[float, tuple[float, float] | None]] = []

    def spy(built: Built) -> None:
        for dev in built.sim.devices:
            feed = dev.feed
            assert feed is not None
            inner = feed.data_at

            def data_at(now: float, inner=inner, feed=feed):  # type: ignore[no-untyped-def]
                data, span = inner(now)
                snap = feed.last  # type: ignore[attr-defined]
                seen.append((now, snap.label_time, snap.arrival, len(data)))
                spans.append((now, span))
                return data, span

            feed.data_at = data_at  # type: ignore[method-assign]
        hook = built.orch.handle

        def handle(event):  # type: ignore[no-untyped-def]
            upd = getattr(event, "update", None)
            if upd is not None and upd.delta is not None:
                assert upd.data_span is not None and upd.data_span[1] <= event.time
            return hook(event)

        built.orch.handle = handle  # type: ignore[method-assign]

    result = run_config(cfg, tmp_path, prepare=spy, plots=False)
    assert len(seen) > 50
    for now, label_time, arrival, n in seen:
        assert (label_time <= now).all() and (arrival <= now).all() and n == len(arrival) <= 60
    assert any(s is not None and s[0] < 0 for _, s in spans)  # warm-up samples are trained on
    st = result.summary["stream"]
    assert st["arrivals"] > 0 and st["dropped_by_cap"] > 0
    assert 0 < st["time_avg_accuracy"] < 1
    assert st["shifts"][0]["at_s"] == 900 and st["shifts"][0]["level_before"] is not None
    assert st["data_age_mean_s"] > 0
    with open(tmp_path / "freshness.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["time_s"]) < 1800 and len(rows) >= 30
    assert json.loads((tmp_path / "config.json").read_text())["stream"]["enabled"] is True


def test_a_run_without_streams_has_no_stream_figures(tmp_path: Path) -> None:
    cfg = resolve_config(None, "fedbuff", nested({**SMALL, "run.max_aggregations": 3}))
    result = run_config(cfg, tmp_path, plots=False)
    assert "stream" not in result.summary
    assert not (tmp_path / "freshness.csv").exists()
    assert "stream" not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"data_plan": "dafl"}, "data_plan 'dafl' plans over fixed client datasets"),
        ({"run.per_client_eval": True}, "per_client_eval"),
        ({"run.cohort": 4}, "run.cohort 4"),
        ({"stream.drift.shifts": [{"kind": "surge", "at_s": 5, "classes": [10]}]}, "class 10 is not one"),
    ],
)
def test_settings_that_do_not_combine_with_streams_are_refused(over: dict[str, object], message: str) -> None:
    cfg = resolve_config(None, "fedbuff", nested({**SMALL, **STREAM, **over}))
    with pytest.raises(ConfigError, match=message):
        run_config(cfg, None, plots=False)
