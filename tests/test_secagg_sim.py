"""Secure aggregation in the simulator: off, a run is exactly as without the section; on, every
aggregation goes through SecAgg+ groups (the same protocol objects), the summary reports them, the
protocol's bytes are counted, and the run is reproducible although every mask is fresh randomness
(the unmasked sums are exact integers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.setup import resolve_config
from felix.secagg.aggregate import SecureSum
from felix.secagg.config import SecureAggregationCfg
from felix.sim.run import run_config

TINY: dict[str, Any] = {
    "partition": {"num_clients": 12},
    "model": "mlp",
    "trace": {"kind": "always"},
    "run": {"max_aggregations": 4, "target_accuracy": 0.3, "target_window": 1, "stop_at_target": False},
    "orchestrator": {"concurrency": 6, "agg_goal": 6},
}


def _run(tmp: Path, name: str, strategy: str, extra: dict[str, Any]) -> tuple[dict[str, Any], str]:
    cfg = resolve_config(None, strategy, {**TINY, **extra})
    run_config(cfg, tmp / name, plots=False)
    return json.loads((tmp / name / "summary.json").read_text()), (tmp / name / "evaluations.csv").read_text()


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "provenance")}


def test_secure_aggregation_none_runs_exactly_as_without_the_section(tmp_path: Path) -> None:
    absent, absent_csv = _run(tmp_path, "absent", "fedbuff", {})
    none, none_csv = _run(
        tmp_path, "none", "fedbuff", {"secure_aggregation": {"protocol": "none", "group_size": 3}}
    )
    assert "secure_aggregation" not in absent and "secure_aggregation" not in none
    assert _comparable(absent) == _comparable(none)
    assert absent_csv == none_csv


def test_a_buffered_run_sums_by_groups_counts_their_bytes_and_is_reproducible(tmp_path: Path) -> None:
    plain, _ = _run(tmp_path, "plain", "fedbuff", {})
    sa = {"secure_aggregation": {"protocol": "buffered", "group_size": 3}}
    one, one_csv = _run(tmp_path, "one", "fedbuff", sa)
    _, two_csv = _run(tmp_path, "two", "fedbuff", sa)
    s = one["secure_aggregation"]
    assert s["protocol"] == "buffered"
    assert s["groups"] == 4 * 2 and s["groups_abandoned"] == 0 and s["updates_lost"] == 0
    assert s["bytes_overhead"] > 0
    total = one["bytes_up"] + one["bytes_down"] - plain["bytes_up"] - plain["bytes_down"]
    assert total == s["bytes_overhead"]
    assert one_csv == two_csv  # fresh masks every run, the same exact sums
    assert abs(one["final_accuracy"] - plain["final_accuracy"]) < 0.05  # only quantisation differs


def test_a_sync_round_with_secagg_plus_reaches_the_same_accuracy(tmp_path: Path) -> None:
    sync = {"orchestrator": {"mode": "sync", "agg_goal": 6}, "aggregator": {"name": "fedavg"}}
    plain, _ = _run(tmp_path, "plain", "fedavg", sync)
    on, _ = _run(
        tmp_path, "on", "fedavg", {**sync, "secure_aggregation": {"protocol": "secagg_plus", "group_size": 8}}
    )
    s = on["secure_aggregation"]
    # 8 dispatched a round (overcommit 1.3), 6 report, 2 are cancelled after sharing: one group
    assert s["groups"] == 4 and s["dropouts_recovered"] == 4 * 2 and s["updates_lost"] == 0
    assert abs(on["final_accuracy"] - plain["final_accuracy"]) < 0.05


class _Stats:
    train_dropped = 0
    train_cancelled = 0


class _Orch:
    def __init__(self) -> None:
        self.stats = _Stats()
        self.version = 3
        from felix.core.types import Tier

        self.clients = {c: type("Rec", (), {"reported_tier": Tier.AVL_TRAIN})() for c in range(20)}


def _buffer(deltas: list[np.ndarray]) -> list[BufferedUpdate]:
    return [
        BufferedUpdate(i, 100 + i, 0, 0.0, ClientUpdate(10 * (i + 1), 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
        for i, d in enumerate(deltas)
    ]


def test_the_secure_step_is_the_weighted_mean_to_quantisation_and_dropped_tasks_are_recovered() -> None:
    rng = np.random.default_rng(3)
    deltas = [rng.normal(0, 0.1, 50) for _ in range(9)]
    buf = _buffer(deltas)
    w = np.array([float(b.update.num_samples) for b in buf])
    orch = _Orch()
    cfg = SecureAggregationCfg(protocol="buffered", group_size=5)
    mech = SecureSum(cfg, "weights", orch, np.random.default_rng(0))
    orch.stats.train_dropped = 2  # two tasks of this aggregation lost their slots after sharing
    step, norm_w = mech.noised_step(buf, w)
    want = sum(wi * d for wi, d in zip(w, deltas)) / w.sum()
    assert np.abs(step - want).max() < 1e-4
    assert np.allclose(norm_w, w / w.sum())
    s = mech.summary()
    assert s["groups"] == 3 and s["dropouts_recovered"] == 2 and s["groups_abandoned"] == 0
