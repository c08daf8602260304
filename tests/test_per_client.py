"""Per-client evaluation (``run.per_client_eval``, felix.metrics.per_client) for any run."""

from __future__ import annotations

import numpy as np
import pytest

from felix.config import parse_set
from felix.engine.setup import resolve_config
from felix.metrics.per_client import PerClientSetup, per_client_metrics
from felix.sim.run import run_config

TINY = [
    "partition.num_clients=8",
    "run.max_aggregations=2",
    "client.max_steps=2",
    "model=mlp",
    "orchestrator.agg_goal=2",
    "orchestrator.concurrency=4",
]


def test_measures_by_hand() -> None:
    # Two classes, 10 test samples each: class 0 at 80%, class 1 at 40%.
    cm = np.array([[8, 2], [6, 4]])
    counts = np.array([[10, 0], [5, 5], [0, 4], [9, 1]])  # class 1 is the minority (10 vs 24)
    p = np.array([0.5, 0.5, 0.05, 0.5])
    m = per_client_metrics(cm, PerClientSetup(counts, p, np.array([1]), rare_p=0.1))
    acc = [0.8, 0.6, 0.4, 0.76]  # the per-class accuracy reweighted to each client's label mix
    assert m["client_acc"] == pytest.approx(acc)
    assert m["mean_client_acc"] == pytest.approx(np.mean(acc)) and m["worst_client_acc"] == pytest.approx(0.4)
    assert m["bottom10_acc"] == pytest.approx(0.4)  # ceil(10% of 4) = 1 client
    assert m["rare_client_acc"] == pytest.approx(0.4) and m["rare_clients"] == [2]
    assert m["per_class_acc"] == pytest.approx([0.8, 0.4]) and m["tail_class_acc"] == pytest.approx(0.4)
    assert m["global_acc"] == pytest.approx(0.6)
    # F1 = 2TP / (2TP + FP + FN): class 0 TP 8 FP 6 FN 2 -> 16/24; class 1 TP 4 FP 2 FN 6 -> 8/16.
    assert m["per_class_f1"] == pytest.approx([2 / 3, 0.5])
    assert m["macro_f1"] == pytest.approx((2 / 3 + 0.5) / 2) and m["minority_f1"] == pytest.approx(0.5)
    assert m["minority_classes"] == [1] and m["std_client_acc"] == pytest.approx(np.std(acc))


def test_rare_clients_survive_ties() -> None:
    """Two participation levels, most clients frequent: only the rank rule's lowest quarter (or
    those at or below rare_p) count as rare, never every client."""
    cm = np.eye(2, dtype=np.int64) * 5
    counts = np.ones((8, 2), dtype=np.int64)
    p = np.array([0.3] * 6 + [0.03] * 2)
    assert per_client_metrics(cm, PerClientSetup(counts, p, np.array([1])))["rare_clients"] == [6, 7]
    assert per_client_metrics(cm, PerClientSetup(counts, p, np.array([1]), 0.03))["rare_clients"] == [6, 7]


def test_setup_rejects_mismatches() -> None:
    with pytest.raises(ValueError, match="participation values"):
        PerClientSetup(np.ones((3, 2)), np.ones(2), np.array([0]))
    with pytest.raises(ValueError, match="data on every row"):
        PerClientSetup(np.array([[1, 0], [0, 0]]), np.ones(2), np.array([0]))


def test_any_run_can_report_per_client_measures() -> None:
    """Off by default (the summary keeps its keys); on, the final model's measures are added and
    agree with the run's own final evaluation."""
    plain = run_config(resolve_config(None, None, parse_set(TINY))).summary
    assert "per_client" not in plain
    on = run_config(resolve_config(None, None, parse_set([*TINY, "run.per_client_eval=true"]))).summary
    pc = on["per_client"]
    assert pc["global_acc"] == pytest.approx(on["final_accuracy"])
    assert len(pc["client_acc"]) == 8 and len(pc["per_class_acc"]) == 10 and pc["finite_model"]
    assert len(pc["rare_clients"]) == 2  # slotted churn: the lowest-availability quarter by rank
    assert {k: v for k, v in on.items() if k not in ("per_client", "wall_time_s", "provenance")} == {
        k: v for k, v in plain.items() if k not in ("wall_time_s", "provenance")
    }


def test_the_mqtt_server_reports_the_same_measures() -> None:
    """The deployment's server attaches per-client evaluation and the convergence rule as the
    simulator does: its run controller's summary has both sections (no broker needed to build it)."""
    from felix.deploy.link import BrokerOptions
    from felix.deploy.server import ServeOptions, Server

    cfg = resolve_config(
        None, None, parse_set([*TINY, "run.per_client_eval=true", "run.converge_threshold=0.01"])
    )
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1, "felix-server", "x"), "t"))
    summ = server.ctl.summary(0.0, 0.0)
    assert len(summ["per_client"]["client_acc"]) == 8
    assert summ["convergence"] == {"round": None, "version": None, "time_s": None}
