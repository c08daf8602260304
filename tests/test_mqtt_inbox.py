"""Review finding 3 of issue 11: the server's and the clients' inboxes (paho threads -> loop) are bounded.

A flood must meet back-pressure before it exhausts memory: the network thread's ``put`` waits
while the bound is reached, and ``close`` (at shutdown) releases it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker, find_mosquitto
from mqtt_support import Background, load_config, users, wait_until, write_config

from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.client import ClientHost, ClientOptions, credentials_from_map
from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import SERVER_USER, Topics
from felix.deploy.transport import Ack, Connected, Delivery

MB = 1 << 20


def inbound(n: int, size: int = MB) -> Delivery:
    return Delivery(Address(Channel.RESULT, 0), bytes(size), Ack(n, 1, 0), "t/result/0")


def result_from(cid: int, payload: bytes, n: int) -> Delivery:
    return Delivery(Address(Channel.RESULT, cid), payload, Ack(n, 1, 0), f"result/{cid}")


def flood(put, n: int) -> threading.Thread:
    def run() -> None:
        for i in range(n):
            put(inbound(i))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_server_inbox_blocks_a_flood_at_its_bound(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}), {"strategy": "fedbuff"}
    )
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t", max_inbox_bytes=4 * MB))
    th = flood(server.inbox.put, 64)  # what paho's network thread does under a 64 MB flood
    th.join(1.0)
    assert th.is_alive(), "64 MB went into the inbox without back-pressure"
    queued = 0
    while batch := server.inbox.get_batch(0.5, 64):  # the loop drains it; the flood completes
        assert all(isinstance(item, Delivery) for _, item in batch)
        queued += len(batch)
    th.join(5.0)
    assert not th.is_alive() and queued == 64


def test_a_client_flooding_refused_messages_cannot_flood_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every refusal is counted, but a client's refusals are logged only at first and then one in
    REFUSALS_LOG_EVERY: a client publishing garbage as fast as it can must not fill the disk."""
    from felix.deploy.refusal_log import REFUSALS_LOG_EVERY, REFUSALS_LOGGED

    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}), {"strategy": "fedbuff"}
    )
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
    n = 2 * REFUSALS_LOG_EVERY + 5
    with caplog.at_level("WARNING", logger="felix"):
        for i in range(n):
            server.handle_inbound(result_from(1, b"garbage", i))  # not a message
        server._on_inbound = lambda m, *_: 1 / 0  # type: ignore[method-assign]  # handling that raises
        server.handle_inbound(result_from(1, b"x", n))
    assert server.stats.rejected == n + 1 and len(server._pending_acks) == n + 1  # all counted and acked
    lines = [r for r in caplog.records if "rejected message from client 1" in r.getMessage()]
    assert len(lines) == REFUSALS_LOGGED + 2  # the first ones, then the 1000th and the 2000th
    assert f"every {REFUSALS_LOG_EVERY}th is logged" in lines[REFUSALS_LOGGED - 1].getMessage()
    assert server.stats.rejected_by_reason  # the summary's tally has them all
    # Made-up ids beyond the population (a broker without ACLs) share one count: no growth per id.
    for i in range(500):
        server.handle_inbound(result_from(10**6 + i, b"x", i))
    assert set(server.refusals.refused) == {1, -1} and server.refusals.refused[-1] == 500


def test_many_clients_refused_together_cannot_flood_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each client's first refusals are within its own limit, but a population of them (stolen
    credentials, or a broker without ACLs) is held to the server-wide budget: after
    REFUSALS_LOGGED_TOTAL lines, only every REFUSALS_LOG_EVERY-th refusal of the server is logged."""
    from felix.deploy.refusal_log import REFUSALS_LOG_EVERY, REFUSALS_LOGGED, REFUSALS_LOGGED_TOTAL

    clients, each = 300, 8
    assert each <= REFUSALS_LOGGED and clients * each > REFUSALS_LOGGED_TOTAL + REFUSALS_LOG_EVERY
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": clients}), {"strategy": "fedbuff"}
    )
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t"))
    with caplog.at_level("WARNING", logger="felix"):
        for i in range(each):
            for cid in range(clients):
                server.handle_inbound(result_from(cid, b"garbage", i * clients + cid))
    total = clients * each
    assert server.stats.rejected == total and sum(server.stats.rejected_by_reason.values()) == total
    lines = [r.getMessage() for r in caplog.records if "rejected message from client" in r.getMessage()]
    # the budget, then the server's 1000th, 2000th, ... refusals (without it: one line per refusal)
    assert len(lines) == REFUSALS_LOGGED_TOTAL + total // REFUSALS_LOG_EVERY
    assert f"{REFUSALS_LOGGED_TOTAL} refused in all" in lines[REFUSALS_LOGGED_TOTAL - 1]
    assert f"{REFUSALS_LOG_EVERY} refused in all" in lines[REFUSALS_LOGGED_TOTAL]
    assert f"{total // REFUSALS_LOG_EVERY * REFUSALS_LOG_EVERY} refused in all" in lines[-1]


def test_inbox_bounds_bytes_and_count_and_close_releases_a_blocked_put() -> None:
    box = Inbox(max_bytes=3 * MB, max_messages=1000)
    th = flood(box.put, 10)
    time.sleep(0.3)
    assert th.is_alive() and len(box) == 3 and box.queued_bytes == 3 * MB and box.full_waits == 1
    box.put(Connected(1, False))  # a connection notice is never held back
    assert len(box) == 4
    box.close()
    th.join(2.0)
    assert not th.is_alive() and box.dropped >= 1
    counted = Inbox(max_bytes=1 << 30, max_messages=2)
    th = flood(counted.put, 3)
    time.sleep(0.3)
    assert th.is_alive() and len(counted) == 2
    assert len(counted.get_batch(0.1, 1)) == 1
    th.join(2.0)
    assert not th.is_alive() and len(counted) == 2
    big = Inbox(max_bytes=MB // 2, max_messages=10)
    big.put(inbound(0))  # larger than the bound, into an empty inbox: admitted, nothing deadlocks
    assert len(big) == 1 and len(big.get_batch(0.1, 8)) == 1 and big.get_batch(0.05, 8) == []


@pytest.mark.mqtt
@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_client_inbox_bounds_a_task_flood_and_loses_nothing(tmp_path: Path) -> None:
    """A flood of task messages to one client while its loop is busy: the client host's inbox
    stays at its bound (the network thread waits, the broker and TCP hold the rest), and once the
    loop resumes every message is handled, the genuine task behind the flood included."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}, trace={"kind": "always"})
    )
    T = Topics("t")
    with MosquittoBroker(2, workdir=tmp_path / "broker") as broker:
        opts = ClientOptions(
            broker=BrokerOptions("127.0.0.1", broker.port),
            run_id="t",
            time_scale=0.01,
            no_train=True,
            max_wall_s=60.0,
            max_inbox_messages=8,
        )
        host = ClientHost(cfg, [0], opts, credentials_from_map(users(broker)))
        gate = threading.Event()
        handled: list[Delivery | Connected] = []
        handle = host.handle

        def busy_then_handle(cid: int, item: Delivery | Connected) -> None:
            gate.wait(30)  # the loop is busy (e.g. training) until the gate opens
            handled.append(item)
            handle(cid, item)

        host.handle = busy_then_handle  # type: ignore[method-assign]
        clients = Background(host.run, "clients")
        clients.start()
        server = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=SERVER_USER)
        server.username_pw_set(SERVER_USER, users(broker)[SERVER_USER])
        try:
            wait_until(lambda: len(handled) == 0 and host.devices[0].link is not None, 15, "client 0")
            server.connect("127.0.0.1", broker.port)
            server.loop_start()
            env = {"run": "t", "sent_at": time.time()}
            flood = [
                wire.encode(wire.Cancel(**env, msg_id=f"s-{i}", client=0, task=1000 + i, reason="x"))
                for i in range(300)
            ]
            task = wire.TrainTask(
                **env, msg_id="s-300", client=0, task=7, version=0, weights=np.zeros(16, np.float32)
            )
            infos = [server.publish(T.task(0), p, qos=1) for p in [*flood, wire.encode(task)]]
            wait_until(lambda: host.inbox.full_waits >= 1, 15, "the inbox to fill")
            time.sleep(0.3)
            assert len(host.inbox) <= 8, "the inbox grew past its bound"
            gate.set()
            wait_until(lambda: len(host.devices[0].sent) == 1, 20, "the task behind the flood to run")
            wait_until(lambda: len(handled) == 302, 10, "every message handled")
            assert all(i.is_published() for i in infos)
            assert sum(isinstance(i, Delivery) for i in handled) == 301  # 300 cancels + the task
        finally:
            gate.set()
            server.disconnect()
            server.loop_stop()
            host.stop_requested.set()
            clients.result(15)
