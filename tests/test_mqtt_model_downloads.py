"""A deployment over Mosquitto whose clients fetch the models over HTTP by hash (``felix serve
--model-http``) reaches its target with exactly-once applies, and no model crosses the broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from broker import MosquittoBroker
from mqtt_support import (
    Background,
    broker_options,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_clients,
    write_config,
)

from felix.deploy.model_store import ModelHosting
from felix.deploy.server import ServeOptions, Server

pytestmark = [*needs_mosquitto, pytest.mark.slow]  # about 20 s


def test_deployment_over_mosquitto_with_http_downloads_reaches_its_target(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml"), {"orchestrator": {"agg_goal": 5, "concurrency": 10}}
    )
    ids = list(range(cfg.partition.num_clients))
    with MosquittoBroker(len(ids), workdir=tmp_path / "broker") as broker:
        opts = ServeOptions(
            broker_options(broker),
            run_id="t",
            out_dir=tmp_path / "out",
            time_scale=0.04,
            status_every_s=1e9,
            models=ModelHosting(),
        )
        server = Server(cfg, opts)
        serving = Background(server.run, "server")
        serving.start()
        host, clients = start_clients(cfg, broker, ids, 0.04)
        try:
            summ = serving.result(90)
            clients.result(20)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()
    assert summ["stop_reason"] == "target_reached"
    assert summ["deployment"]["applied_task_ids_unique"]
    down = summ["wire_bytes_by_kind"]["down"]
    model = 4 * server.num_params
    tasks = summ["transport"]["messages_out"]  # tasks and cancels
    assert down["train"] + down["eval"] < 2000 * tasks < model * tasks  # no model crossed the broker
    assert summ["deployment"]["models"]["bytes_served"] >= model * summ["aggregations"] // 2
