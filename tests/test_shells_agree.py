"""One tiny scenario through both shells, the simulator and the MQTT server with emulated clients on
a real Mosquitto (127.0.0.1): the run controller counts bytes by one model, so the counters that
must agree do.

What agrees exactly: the byte categories, the size of each kind of message (so every byte counter
is its message count times that size in both shells), the registrations' bytes (every client
registers once in both), the evaluation cadence (the initial model and every version up to
``max_aggregations``) and the stop reason. What may differ, and why: how many tasks were
dispatched, finished or cancelled by the time the run stopped. The simulator's clock is virtual and
its clients register all at t=0; over MQTT they register as they connect, train on wall-clock
timers and their results race the server's evaluations, so the event sequences differ after the
first few events and the strategy (random or Oort selection) sees different histories.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_clients,
    start_server,
    wait_until,
    write_config,
)

from felix.engine.controller import EVAL_RESULT_BYTES
from felix.metrics.recorder import HEADER_BYTES
from felix.sim.run import run_config

pytestmark = needs_mosquitto
SCALE = 0.02  # 10 config seconds a task = 0.2 wall seconds
CLIENTS = 6
AGGREGATIONS = 3
KINDS = {"train", "eval", "control"}


def _per_message(total: int, count: int) -> float | None:
    return total / count if count else None


@pytest.mark.parametrize("strategy", ["fedbuff", "felix"])
def test_both_shells_count_the_same_bytes(tmp_path: Path, strategy: str) -> None:
    path = write_config(tmp_path / "cfg.yaml", partition={"num_clients": CLIENTS}, trace={"kind": "always"})
    cfg = load_config(
        path,
        {
            "strategy": strategy,
            "orchestrator": {"agg_goal": 2, "concurrency": 3},
            "run": {"max_aggregations": AGGREGATIONS, "stop_at_target": False, "target_accuracy": 1.0},
        },
    )
    sim = run_config(cfg, None, plots=False)
    s = sim.summary
    with MosquittoBroker(CLIENTS, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", SCALE)
        host, clients = start_clients(cfg, broker, list(range(CLIENTS)), SCALE)
        try:
            m = thread.result(60)
            clients.result(30)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()

    model = 4 * s["num_params"] + HEADER_BYTES
    registrations = CLIENTS * (HEADER_BYTES + 8 * 10)
    sizes = {}
    for name, summ in (("sim", s), ("mqtt", m)):
        b, d = summ["bytes_by_kind"], summ["diagnostics"]
        assert set(b["down"]) == set(b["up"]) == KINDS, name
        assert summ["stop_reason"] == "max_aggregations" and summ["aggregations"] == AGGREGATIONS, name
        assert summ["evaluations"] == AGGREGATIONS + 1, name  # versions 0..3, the same cadence
        assert b["down"]["eval"] == d["eval_dispatched"] * model, name
        assert b["up"]["eval"] % EVAL_RESULT_BYTES == 0 and b["down"]["control"] % HEADER_BYTES == 0, name
        if strategy == "fedbuff":  # no aux, no data plan: a training message is a bare model
            assert b["down"]["train"] == d["train_dispatched"] * model, name
            assert b["up"]["train"] % model == 0 and b["up"]["train"] >= summ["updates_applied"] * model, name
        sizes[name] = _per_message(b["down"]["train"], d["train_dispatched"])
    assert sizes["sim"] == sizes["mqtt"], "a training task costs the same bytes in both shells"
    assert (strategy == "felix") == (s["diagnostics"]["eval_dispatched"] > 0), "TierSelect sends eval tasks"

    # Control upstream: the registrations, plus each tier report when tiers are tracked (felix's
    # TierTrack; a re-registration reaches the orchestrator as a tier report). The trace keeps
    # every client available, so the simulator has no tier changes at all.
    assert s["bytes_by_kind"]["up"]["control"] == registrations
    t = m["transport"]
    reports = t["tier_messages"] + t["re_registrations"] if strategy == "felix" else 0
    assert m["bytes_by_kind"]["up"]["control"] == registrations + HEADER_BYTES * reports

    # The server also reports what crossed the wire (its encoding), in the same categories; the
    # simulator has no wire.
    assert "wire_bytes_by_kind" not in s
    wire = m["wire_bytes_by_kind"]
    assert set(wire["down"]) == set(wire["up"]) == KINDS and wire["down"]["train"] > 0


def test_interrupted_server_keeps_its_evaluations(tmp_path: Path) -> None:
    """``felix serve`` on Ctrl-C / SIGTERM (its CLI sets ``stop_requested``): the run ends
    ``interrupted``, with the evaluations it wrote as they happened."""

    def rows() -> list[dict[str, str]]:
        try:
            with open(tmp_path / "out" / "evaluations.csv", newline="") as f:
                return list(csv.DictReader(f))
        except FileNotFoundError:
            return []

    path = write_config(tmp_path / "cfg.yaml", partition={"num_clients": CLIENTS}, trace={"kind": "always"})
    cfg = load_config(
        path,
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 2, "concurrency": 3},
            "run": {"stop_at_target": False},
        },
    )
    with MosquittoBroker(CLIENTS, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", SCALE)
        host, clients = start_clients(cfg, broker, list(range(CLIENTS)), SCALE)
        try:
            wait_until(lambda: len(rows()) >= 3, 60, "three evaluations on disk")
            assert not (tmp_path / "out" / "summary.json").exists()
            server.stop_requested.set()
            m = thread.result(30)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()
            clients.result(30)
    assert m["stop_reason"] == "interrupted"
    written = rows()
    assert len(written) == m["evaluations"] >= 3 and int(written[-1]["version"]) == m["aggregations"]


def test_the_server_and_the_simulator_evaluate_alike(tmp_path: Path) -> None:
    """Both shells build their evaluator through felix.engine.setup: under ``run.precision: bf16``
    the MQTT server's evaluation of a model is the simulator's to the bit (its own setup once ran
    the evaluator without the configured autocast)."""
    from felix import api
    from felix.deploy.link import BrokerOptions
    from felix.deploy.server import ServeOptions, Server

    results = {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(write_config(tmp_path / f"{precision}.yaml"), {"run": {"precision": precision}})
        server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
        sim = api.build(cfg)
        weights = sim.population.initial_weights
        results[precision] = server.ctl.rec.evaluate(weights)
        assert results[precision] == sim.recorder.evaluate(weights)
    assert results["fp32"][1] != results["bf16"][1]  # the autocast shows in the loss


@pytest.mark.parametrize("optimizer", ["momentum", "yogi"])
def test_both_shells_take_the_same_server_step(tmp_path: Path, optimizer: str) -> None:
    """The simulator and the MQTT server build one aggregator from the config, server optimiser
    included: the same buffers give the same models, step after step (the moments carry over)."""
    import numpy as np

    from felix import api
    from felix.core.types import BufferedUpdate, ClientUpdate
    from felix.deploy.link import BrokerOptions
    from felix.deploy.server import ServeOptions, Server

    path = write_config(tmp_path / "cfg.yaml", partition={"num_clients": CLIENTS})
    cfg = load_config(path, {"strategy": "felix-authors", "aggregator": {"server_optimizer": optimizer}})
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
    sim = api.build(cfg)
    rng = np.random.default_rng(0)
    models = {"sim": sim.orch.weights, "mqtt": server.orch.weights}
    n = models["sim"].size
    for _ in range(3):
        buffer = [
            BufferedUpdate(
                c, c, 0, 0.0, ClientUpdate(20, 3.0 + c, 1.0, 5.0, rng.normal(0, 0.01, n).astype(np.float32))
            )
            for c in range(2)
        ]
        models["sim"] = sim.orch.aggregator.aggregate(models["sim"], buffer)[0]
        models["mqtt"] = server.orch.aggregator.aggregate(models["mqtt"], buffer)[0]
        assert models["sim"].tobytes() == models["mqtt"].tobytes()
    assert server.orch.aggregator.optimizer.name == sim.orch.aggregator.optimizer.name == optimizer
