"""Start-up and resume cannot hang (over a real broker on 127.0.0.1).

The attack: while the server is down, one login publishes 70 x 1 MB on its own result topic. The
broker delivers that backlog to the resumed session before the SUBACK; it filled the server's
inbox, ``link.start`` timed out waiting for the SUBACK, and ``close()`` joined the network thread
blocked on the full inbox: the process hung for good, deaf to SIGTERM.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker
from mqtt_support import (
    Background,
    broker_options,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    users,
    wait_serving,
    wait_until,
    write_config,
)

from felix.deploy.link import Inbound, MqttLink
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import Topics

pytestmark = needs_mosquitto
T = Topics("t")


@pytest.mark.parametrize("link_process", [False, True], ids=["one-process", "link-process"])
def test_a_resume_after_a_hostile_backlog_serves(tmp_path: Path, link_process: bool) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {"strategy": "fedbuff", "orchestrator": {"agg_goal": 1, "concurrency": 1}},
    )
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        opts = ServeOptions(
            dataclasses.replace(broker_options(broker), connect_timeout_s=5.0),
            run_id="t",
            out_dir=tmp_path / "out",
            checkpoint=tmp_path / "ck.safetensors",
            max_inbox_bytes=16 << 20,  # the backlog is four times the inbox
            status_every_s=1e9,
            link_process=link_process,
        )
        first = Server(cfg, opts)
        thread = Background(first.run, "first life")
        thread.start()
        wait_serving(first, 20, "the first life to connect and subscribe")
        first.stop_requested.set()
        thread.result(30)
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        raw.username_pw_set("client-0", users(broker)["client-0"])
        raw.max_inflight_messages_set(100)
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        try:
            junk = b"FLXM" + bytes(1 << 20)
            for info in [raw.publish(T.result(0), junk, qos=1) for _ in range(70)]:
                info.wait_for_publish(10)
        finally:
            raw.disconnect()
            raw.loop_stop()
        resumed = Server(cfg, dataclasses.replace(opts, resume=True))
        thread = Background(resumed.run, "resumed life")
        thread.start()
        try:
            wait_until(lambda: resumed.stats.messages_in >= 40, 60, "the resumed server to drain the backlog")
        finally:
            resumed.stop_requested.set()
        summ = thread.result(30)
    refused = summ["transport"]["refused_by_kind"]
    assert sum(refused.values()) >= 40 and set(refused) <= {"unknown_version", "rate_limit", "cost_limit"}
    assert summ["deployment"]["lives"] == 2


@pytest.mark.parametrize("link_process", [False, True], ids=["one-process", "link-process"])
def test_sigterm_is_honoured_while_the_broker_does_not_answer(tmp_path: Path, link_process: bool) -> None:
    """A broker that accepts the connection and never answers: ``felix serve`` waits for its
    CONNACK, and SIGTERM ends that wait at once, with a clear message and a non-zero exit (with
    ``--link-process`` too: the child waits for the CONNACK, the server for the child)."""
    cfg = write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4})
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    accepted = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        silent.settimeout(60)
        try:
            conns.append(silent.accept()[0])
            accepted.set()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    log = tmp_path / "serve.log"
    args = ["serve", str(cfg), "--broker", f"127.0.0.1:{port}", "--username", "felix-server"]
    extra = ["--link-process"] if link_process else []
    proc = spawn([*args, "--password", "x", "--out", str(tmp_path / "out"), *extra], log)
    try:
        assert accepted.wait(60), "felix serve never connected"
        proc.send_signal(signal.SIGTERM)
        (code,) = reap(proc, timeout=5.0)
    finally:
        silent.close()
        for c in conns:
            c.close()
    text = log.read_text()
    assert code is not None, f"felix serve ignored SIGTERM for 5 s:\n{text[-2000:]}"
    assert code == 2  # a start-up error, not a crash
    assert "stopped while waiting for the broker" in text
    assert "Traceback" not in text


def test_close_does_not_wait_forever_for_a_network_thread_blocked_in_its_sink(tmp_path: Path) -> None:
    """paho's ``loop_stop`` joins the network thread without a limit; a thread blocked in its
    owner's sink (a full inbox nobody drains) held ``close`` and the process for good."""
    release = threading.Event()

    def stuck(item: object) -> None:
        if isinstance(item, Inbound):
            release.wait(60)  # the owner never takes it

    with MosquittoBroker(2, workdir=tmp_path / "broker") as broker:
        opts = dataclasses.replace(broker_options(broker), connect_timeout_s=10.0)
        link = MqttLink("srv", opts, T.server_subscriptions(), stuck, manual_ack=True)
        link.start(fresh=True)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        pub.username_pw_set("client-0", users(broker)["client-0"])
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        try:
            pub.publish(T.state(0), b"x", qos=1).wait_for_publish(5)
            wait_until(
                lambda: link._client._thread is not None and link._handing_over, 10, "the sink to block"
            )
            closing = Background(lambda: link.close(timeout=1.0), "close")
            closing.start()
            closing.result(10)
        finally:
            release.set()
            pub.disconnect()
            pub.loop_stop()
