"""``felix serve --metrics-port``: a deployment on a real Mosquitto is scraped over loopback while it
trains, and the Prometheus families move with the server's own state; a bad port is one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_clients,
    start_server,
    users,
    wait_serving,
    wait_until,
    write_config,
)
from prometheus_client.parser import text_string_to_metric_families

from felix.deploy.metrics import MetricsEndpoint, MetricsError
from felix.deploy.topics import Topics

SCALE = 0.02  # 1 config second = 20 ms: a 10 s task takes 0.2 s


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of the endpoint, by name and then by its sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@pytest.mark.mqtt
@pytest.mark.usefixtures("one_torch_thread")
@needs_mosquitto[1]
def test_a_scrape_follows_the_running_server(tmp_path: Path) -> None:
    n = 12
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": n}),
        {"strategy": "fedbuff", "orchestrator": {"agg_goal": 3, "concurrency": 6}},
    )
    with MosquittoBroker(n, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", SCALE)
        endpoint = MetricsEndpoint(server, "127.0.0.1", 0)
        host = None
        try:
            wait_serving(server)
            quiet = scrape(endpoint.port)
            assert one(quiet, "felix_clients_registered") == 0
            assert one(quiet, "felix_model_versions_total") == 0
            assert one(quiet, "felix_broker_connected", shard="0", broker=f"127.0.0.1:{broker.port}") == 1
            assert one(quiet, "felix_run_info", run_id="t", strategy="fedbuff", session=server.session) == 1

            # A garbage result from a valid login: refused as bad_magic, counted by kind.
            raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-0", protocol=mqtt.MQTTv5)
            raw.username_pw_set("client-0", users(broker)["client-0"])
            raw.connect("127.0.0.1", broker.port)
            raw.loop_start()
            try:
                raw.publish(Topics("t").result(0), b"JUNK" + bytes(64), qos=1).wait_for_publish(5)
            finally:
                raw.disconnect()
                raw.loop_stop()
            wait_until(lambda: server.stats.rejected >= 1, 10, "the junk to be refused")

            host, _ = start_clients(cfg, broker, list(range(n)), SCALE, no_train=True)
            wait_until(lambda: len(server.orch.clients) == n and server.orch.version >= 2, 30, "training")
            first = scrape(endpoint.port)
            wait_until(
                lambda: server.orch.version >= one(first, "felix_model_versions_total") + 3,
                30,
                "more versions",
            )
            second = scrape(endpoint.port)
        finally:
            endpoint.close()
            if host is not None:
                host.stop_requested.set()
            server.stop_requested.set()
        summ = thread.result(30)

    # The deployed shell measures the aggregator's stall as the simulator does: no training task
    # held a slot before the first client registered, which was after the quiet scrape.
    idle = one(quiet, "felix_virtual_time_seconds")
    assert idle > 0 and summ["diagnostics"]["aggregator_stall_s"] >= idle
    v1, v2 = one(first, "felix_model_versions_total"), one(second, "felix_model_versions_total")
    assert 2 <= v1 < v1 + 3 <= v2 <= summ["aggregations"]
    assert one(second, "felix_model_version") == v2
    for s in (first, second):
        by_tier = {dict(k)["tier"]: v for k, v in s["felix_clients"].items()}
        assert set(by_tier) == {"UN_AVL", "AVL_EVAL", "AVL_TRAIN"}
        assert sum(by_tier.values()) == one(s, "felix_clients_registered") == n
        assert one(s, "felix_broker_clients", shard="0", broker=f"127.0.0.1:{broker.port}") == n
    assert one(second, "felix_transport_registrations_total") >= n
    assert one(second, "felix_refusals_total", kind="bad_magic") == 1
    dispatched = [one(s, "felix_orchestrator_train_dispatched_total") for s in (first, second)]
    assert 0 < dispatched[0] < dispatched[1] <= summ["diagnostics"]["train_dispatched"]
    # And records what it knew of the clients it picked: with 15 updates or more from 12 clients,
    # some client was picked after its reply had told the server its utility and its duration.
    assert (
        summ["diagnostics"]["selected_utility_p50"] > 0 and summ["diagnostics"]["selected_compute_s_p50"] > 0
    )
    assert {dict(k)["state"] for k in second["felix_tasks"]} == {"in_flight", "interrupted", "timed_out"}
    open_tasks = sum(second["felix_tasks"].values())
    assert open_tasks <= cfg.orchestrator.concurrency + n  # slots, and at most one late task a client
    assert one(second, "felix_admission_tier_changes_total") <= summ["admission"]["tier_changes"]
    # The per-login download budget's counters (on by default): every task sent was debited.
    debited = one(second, "felix_download_budget_bytes_debited_total")
    assert 0 < debited <= summ["deployment"]["download_budget"]["bytes_debited"]
    assert one(second, "felix_inbox_max_messages") == server.inbox.max_messages
    assert second["felix_inbox_messages"][()] < server.inbox.max_messages


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cfg = write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4})
    try:
        with pytest.raises(MetricsError, match=f"127.0.0.1:{port}"):
            MetricsEndpoint(None, "127.0.0.1", port)  # type: ignore[arg-type]  # fails before reading it
        cmd = [sys.executable, "-m", "felix.deploy", "serve", str(cfg), "--out", str(tmp_path / "out")]
        for flag, lines in (
            (["--metrics-port", str(port)], "metrics endpoint 127.0.0.1"),
            (["--metrics-port", "70000"], "--metrics-port 70000 is outside 1-65535"),
        ):
            r = subprocess.run(cmd + flag, check=False, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2
            assert r.stderr.strip().splitlines()[-1].startswith(f"felix serve: error: {lines}")
            assert len([ln for ln in r.stderr.splitlines() if "error" in ln]) == 1
    finally:
        busy.close()
