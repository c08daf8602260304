"""The same small deployment over the in-memory transport and over MQTT applies the same updates.

A server and three client hosts (one client each, in threads) run FedBuff with one task at a
time; the clients join one by one, each waiting until the one before it is registered, and a
task lasts long enough for all to be registered before the first result, so every selection
sees the same clients in the same order and the seeded selector draws alike. The transport is
the only difference between the two runs, so their audit trails (version, task, client,
staleness, weight) must match row for row.
"""

from __future__ import annotations

import csv
from pathlib import Path

from broker import MosquittoBroker
from mqtt_support import (
    Background,
    broker_options,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    users,
    wait_until,
    write_config,
)

from felix.config import Config
from felix.deploy.client import ClientHost, ClientOptions, credentials_from_map
from felix.deploy.link import BrokerOptions
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.transport import LinkOptions

pytestmark = needs_mosquitto
SCALE = 0.1  # a 10 s task lasts 1 s of wall time: the three clients register well within it
CLIENTS = [0, 1, 2]


def _config(tmp_path: Path) -> Config:
    return load_config(
        write_config(
            tmp_path / "cfg.yaml", partition={"num_clients": len(CLIENTS)}, trace={"kind": "always"}
        ),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 1},
            "run": {"max_aggregations": 4, "target_accuracy": 1.0},
        },
    )


def deploy(
    cfg: Config, out: Path, transport: str, server_broker: LinkOptions, client_broker: LinkOptions, creds
) -> list[tuple[str, ...]]:
    """Run the deployment over ``transport``; the applied updates without their times."""
    run_id = f"agree-{transport}"
    server = Server(
        cfg,
        ServeOptions(
            server_broker,
            run_id=run_id,
            out_dir=out,
            time_scale=SCALE,
            status_every_s=1e9,
            transport=transport,
        ),
    )
    serving = Background(server.run, "server")
    serving.start()
    hosts: list[tuple[ClientHost, Background]] = []
    try:
        for cid in CLIENTS:
            opts = ClientOptions(
                broker=client_broker, run_id=run_id, time_scale=SCALE, max_wall_s=60.0, transport=transport
            )
            host = ClientHost(cfg, [cid], opts, creds)
            hosts.append((host, Background(host.run, f"client-{cid}")))
            hosts[-1][1].start()
            wait_until(lambda c=cid: c in server.orch.clients, 30, f"client {cid} to register")
        summ = serving.result(60)
        for _, thread in hosts:
            thread.result(20)
    finally:
        server.stop_requested.set()
        for host, _ in hosts:
            host.stop_requested.set()
    assert summ["stop_reason"] == "max_aggregations"
    with open(out / "applied_updates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [tuple(v for k, v in row.items() if k != "time_s") for row in rows]


def test_in_memory_and_mqtt_apply_the_same_updates(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    memory = deploy(
        cfg, tmp_path / "memory", "memory", MemoryOptions(), MemoryOptions(), lambda cid: (None, None)
    )
    with MosquittoBroker(len(CLIENTS), workdir=tmp_path / "broker") as broker:
        mqtt = deploy(
            cfg,
            tmp_path / "mqtt",
            "mqtt",
            broker_options(broker),
            BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
            credentials_from_map(users(broker)),
        )
    assert len(memory) == 4  # one update per aggregation
    assert len({row[2] for row in memory}) > 1  # several clients trained
    assert memory == mqtt
