"""Deployment hardening (issue 11, findings 4, 6 and 7) over a real broker on 127.0.0.1.

- a flood of 1 MB junk messages leaves the server's memory flat (pending acknowledgements keep
  no payloads; the pending bound forces a checkpoint);
- a result the broker acknowledged survives a ``kill -9`` of the broker (its client publishes it
  again after reconnecting);
- ``felix emulate`` starts in time linear in the clients (the trace is built once, not per
  worker) and its workers stop within 5 s of SIGTERM, even with the broker gone.
"""

from __future__ import annotations

import signal
import time
import tracemalloc
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker
from mqtt_support import (
    broker_options,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    start_clients,
    start_server,
    users,
    wait_serving,
    wait_until,
    write_config,
)

from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.link import Connected, Inbound, MqttLink
from felix.deploy.topics import Topics
from felix.deploy.transport import Ack, Delivery

pytestmark = needs_mosquitto
T = Topics("t")


def test_junk_flood_keeps_server_memory_flat(tmp_path: Path) -> None:
    """Finding 4: 150 junk messages of 1 MB each (valid login, garbage payload) do not stay in the
    server's memory until the next checkpoint (there is none: nothing is ever applied); the
    pending bound forces a durable point and the acknowledgements go out."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {"strategy": "fedbuff", "orchestrator": {"agg_goal": 1, "concurrency": 1}},
    )
    n_junk = 150
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", 1.0, tmp_path / "ck.safetensors")
        u = users(broker)
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="raw-0", protocol=mqtt.MQTTv5)
        raw.username_pw_set("client-0", u["client-0"])
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        tracemalloc.start()
        try:
            wait_serving(server)
            base = tracemalloc.get_traced_memory()[0]
            junk = b"FLXM" + bytes(1 << 20)
            for _ in range(n_junk):
                raw.publish(T.result(0), junk, qos=1).wait_for_publish(5)
            wait_until(lambda: server.stats.messages_in >= n_junk, 60, "the server to read the flood")
            time.sleep(0.5)
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
            raw.disconnect()
            raw.loop_stop()
            server.stop_requested.set()
        thread.result(30)
    assert server.stats.rejected >= n_junk
    assert grown < 32 * 2**20, f"server memory grew by {grown / 2**20:.0f} MB under a {n_junk} MB flood"
    assert server.stats.checkpoints >= 1, "the pending bound (64 MiB) forces a checkpoint"


@pytest.mark.slow
def test_acknowledged_result_survives_broker_kill9(tmp_path: Path) -> None:
    """Finding 6: a client's result, acknowledged by the broker while the server is away, is
    not lost when the broker is killed with SIGKILL before its next autosave."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}, trace={"kind": "always"})
    )
    with MosquittoBroker(2, workdir=tmp_path / "broker") as broker:
        got: list[Inbound | Connected] = []
        srv = broker_options(broker)
        monitor = MqttLink("felix-t-server", srv, [f"{T.root}/server/result/+"], got.append)
        monitor.start(fresh=True)
        monitor.close()  # away, with a persistent session that queues its messages
        time.sleep(5.5)  # an autosave (every 5 s) holds that session from now on
        host, clients = start_clients(cfg, broker, [0], 0.01, no_train=True)
        try:
            wait_until(
                lambda: host.devices[0].link is not None and host.devices[0].link.connected, 10, "client 0"
            )
            task = wire.TrainTask(
                run="t",
                msg_id="s-1",
                sent_at=time.time(),
                client=0,
                task=7,
                version=0,
                plan=(),
                weights=np.zeros(16, np.float32),
                aux={},
            )
            db = broker.dir / "db" / "mosquitto.db"

            def saved_at() -> int:
                return db.stat().st_mtime_ns if db.exists() else 0

            before = saved_at()
            wait_until(lambda: saved_at() != before, 12, "an autosave")  # the next is 5 s away
            host.inbox.put(Delivery(Address(Channel.TASK, 0), wire.encode(task), Ack(1, 1, 1), "task/0"), 0)
            wait_until(lambda: len(host.devices[0].sent) == 1, 10, "the result to be published")
            time.sleep(0.3)  # the broker acknowledges it (QoS 1) and queues it for the server
            broker.restart(crash=True)  # kill -9 well before the next autosave
            back = MqttLink("felix-t-server", srv, [f"{T.root}/server/result/+"], got.append)
            back.start(fresh=False)

            def delivered() -> bool:
                return any(isinstance(m, Inbound) and wire.decode(m.payload).task == 7 for m in got)  # type: ignore[union-attr]

            wait_until(delivered, 15, "the acknowledged result to reach the server")
            back.close()
        finally:
            host.stop_requested.set()
            clients.result(15)


@pytest.mark.slow
def test_emulate_starts_linearly_and_stops_on_sigterm(tmp_path: Path) -> None:
    """Finding 7: 20 clients of a 4,000-client population (a 1 s slotted trace over two hours) in
    two workers register within 40 s, most of it importing torch and loading the dataset (each
    worker used to build all 4,000 device traces, 29 million trace events, first: ~50 s);
    with the broker then killed, SIGTERM stops the workers within 5 s (they used to wait a
    second per client for paho's reconnect loop)."""
    path = write_config(
        tmp_path / "cfg.yaml",
        partition={"kind": "iid", "num_clients": 4000},
        trace={"kind": "slotted", "unavailable_fraction": 0.0, "slot_s": 1.0, "horizon_s": 7200.0},
    )
    cfg = load_config(path, {"orchestrator": {"knowledge": "tiertrack"}})
    with MosquittoBroker(4000, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(cfg, broker, tmp_path / "out", 1.0)
        started = time.monotonic()
        emulate = spawn(
            [
                "emulate",
                str(path),
                "--set",
                "orchestrator.knowledge=tiertrack",
                "--broker",
                broker.address,
                "--run-id",
                "t",
                "--credentials",
                str(broker.credentials_file),
                "--clients",
                "20",
                "--processes",
                "2",
                "--no-train",
                "--max-wall-s",
                "120",
            ],
            tmp_path / "emu.log",
        )
        try:
            wait_until(lambda: len(server.orch.clients) >= 20, 40, "20 emulated clients to register")
            took = time.monotonic() - started
            broker.kill()
            t0 = time.monotonic()
            emulate.send_signal(signal.SIGTERM)
            code = reap(emulate, timeout=10)
            stopped = time.monotonic() - t0
        finally:
            server.stop_requested.set()
            reap(emulate)
        thread.result(30)
    assert code == [130] and stopped < 5.0, f"emulate took {stopped:.1f} s to stop (exit {code})"
    assert took < 40.0
