"""The generated Mosquitto configuration: limits sized to the model, queues bounded."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from broker import find_mosquitto, free_port

from felix.deploy.broker_config import (
    CLIENT_INFLIGHT,
    MIN_QUEUED_BYTES,
    PACKET_OVERHEAD,
    BrokerLimits,
    default_max_message_bytes,
    mosquitto_conf,
)
from felix.deploy.cli import main as deploy_main
from felix.deploy.link import Inbound, MqttLink
from felix.deploy.topics import Topics


def _settings(text: str) -> dict[str, str]:
    pairs = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def test_limits_follow_the_model_and_bound_the_queues() -> None:
    limits = BrokerLimits.for_run(100, 30, default_max_message_bytes(6090))
    assert limits.max_message_bytes == 8 * 6090 + (1 << 20)  # what the server accepts, about 1.1 MB
    assert limits.max_packet_size == limits.max_message_bytes + PACKET_OVERHEAD
    assert limits.max_queued_messages == 10_000
    assert limits.max_queued_bytes == MIN_QUEUED_BYTES
    big = BrokerLimits.for_run(100, 30, default_max_message_bytes(537_000))
    assert big.max_queued_bytes == 2 * 30 * big.max_message_bytes
    with pytest.raises(ValueError, match="0 means unbounded"):
        BrokerLimits(max_message_bytes=1, max_queued_messages=1, max_queued_bytes=0)


def test_mqtt_credentials_writes_a_conf_sized_to_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "broker"
    code = deploy_main(
        ["mqtt-credentials", "--preset", "felix", "--set", "partition.num_clients=5", "--out", str(out)]
    )
    assert code == 0
    assert "sized to 6,090 parameters" in capsys.readouterr().err
    conf = _settings((out / "mosquitto.conf").read_text())
    assert conf["message_size_limit"] == str(8 * 6090 + (1 << 20))
    assert conf["max_packet_size"] == str(8 * 6090 + (1 << 20) + PACKET_OVERHEAD)
    assert conf["max_queued_messages"] == "1000" and conf["max_queued_bytes"] == str(MIN_QUEUED_BYTES)
    assert conf["max_inflight_messages"] == str(CLIENT_INFLIGHT)  # never 0 (unbounded)
    assert conf["listener"] == "1883 127.0.0.1"
    assert conf["password_file"] == str((out / "passwd").resolve())
    assert (out / "db").is_dir()
    # Without a config: the wire format's 64 MiB, said so; an explicit size wins.
    code = deploy_main(["mqtt-credentials", "--clients", "3", "--out", str(out), "--listen", "0.0.0.0:8883"])
    assert code == 0 and "not sized to a model" in capsys.readouterr().err
    assert _settings((out / "mosquitto.conf").read_text())["message_size_limit"] == str(64 << 20)
    code = deploy_main(["mqtt-credentials", "--clients", "3", "--out", str(out), "--max-message-bytes", "0"])
    assert code == 2 and "max_message_bytes must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_mosquitto_accepts_the_generated_conf(tmp_path: Path) -> None:
    """Mosquitto 2 parses every line (an unknown or misspelt option would stop it at once)."""
    (tmp_path / "passwd").write_text("")
    (tmp_path / "acl").write_text("")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(
        mosquitto_conf(
            listen=("127.0.0.1", port),
            password_file=tmp_path / "passwd",
            acl_file=tmp_path / "acl",
            persistence_dir=tmp_path,
            limits=BrokerLimits.for_run(10, 5, default_max_message_bytes(1000)),
            log_file=tmp_path / "log",
        )
    )
    binary = find_mosquitto()
    assert binary is not None
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.5)  # still running: the configuration was accepted
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert b"Error" not in err, err


@pytest.mark.mqtt
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto broker not installed")
def test_a_connected_clients_in_flight_is_bounded_and_the_servers_window_is_larger(tmp_path: Path) -> None:
    """Under the generated configuration a client's connection holds at most ``CLIENT_INFLIGHT``
    unacknowledged messages (0 let a connection that fell behind hold everything in the broker),
    while the server's link, which asks for its own Receive Maximum, gets 3,000 messages in flight
    without acknowledging one: it is not the connection that fills up and loses messages."""
    from broker import MosquittoBroker
    from mqtt_support import broker_options, users, wait_until

    topics = Topics("t")
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        slow: list[int] = []
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-1", protocol=mqtt.MQTTv5)
        client.manual_ack_set(True)  # and never acknowledges
        client.username_pw_set("client-1", u["client-1"])
        client.on_message = lambda c, d, m: slow.append(m.mid)
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        inbound: list[Inbound] = []
        link = MqttLink(
            "server",
            replace(broker_options(broker), receive_maximum=20_000),
            topics.server_subscriptions(),
            lambda item: inbound.append(item) if isinstance(item, Inbound) else None,
            manual_ack=True,  # and never acknowledges
        )
        link.start(fresh=True)
        sender = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-2", protocol=mqtt.MQTTv5)
        sender.username_pw_set("client-2", u["client-2"])
        sender.max_inflight_messages_set(1000)
        sender.connect("127.0.0.1", broker.port)
        sender.loop_start()
        try:
            client.subscribe(topics.task(1), qos=1)
            time.sleep(0.5)
            for _ in range(200):
                link.publish(topics.task(1), b"task")
            for _ in range(3000):
                sender.publish(topics.state(2), b"state", qos=1)
            wait_until(lambda: len(inbound) >= 3000, 30, "the server link to hold 3,000 messages")
            time.sleep(0.5)
        finally:
            for c in (client, sender):
                c.disconnect()
                c.loop_stop()
            link.close()
    assert len(slow) == CLIENT_INFLIGHT
    assert len(inbound) == 3000
