"""The link's intake (issue 11, item 6): PUBLISH packets parsed without paho's per-message objects,
each read pass handed over at once, and acknowledgements sent only for what the owner took.

The fast path must not change what the owner sees: every message, in order, with its packet id
and connection epoch, whatever paho would have delivered (QoS 2 and MQTT 5 properties still take
paho's path); an owner that acknowledges (the server) gets redeliveries of what it did not ack,
and an owner that does not (a client host) has nothing redelivered once it took the message."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker, find_mosquitto
from mqtt_support import users, wait_until
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions, Inbound, MqttLink, parse_publish
from felix.deploy.topics import SERVER_USER


def publish_body(topic: str, payload: bytes, mid: int | None, props: bytes | None) -> bytes:
    """A PUBLISH body (after the fixed header): topic, packet id at QoS > 0, MQTT 5 properties."""
    t = topic.encode()
    out = struct.pack("!H", len(t)) + t
    if mid is not None:
        out += struct.pack("!H", mid)
    if props is not None:
        out += props
    return out + payload


def test_parse_publish_takes_what_it_knows_and_leaves_the_rest_to_paho() -> None:
    v5 = publish_body("felix/r/server/state/3", b"\x00payload", 513, b"\x00")
    assert parse_publish(v5, 1, True) == ("felix/r/server/state/3", 513, b"\x00payload")
    assert parse_publish(bytearray(v5), 1, True) == ("felix/r/server/state/3", 513, b"\x00payload")
    assert parse_publish(publish_body("a/b", b"x", None, b"\x00"), 0, True) == ("a/b", 0, b"x")
    assert parse_publish(publish_body("a/b", b"x", 7, None), 1, False) == ("a/b", 7, b"x")
    assert parse_publish(publish_body("a/b", b"", 7, b"\x00"), 1, True) == ("a/b", 7, b"")
    # MQTT 5 properties (here a content type), a cut packet, a bad topic: paho's own path.
    assert parse_publish(publish_body("a/b", b"x", 7, b"\x05\x03\x00\x02ab"), 1, True) is None
    assert parse_publish(publish_body("a/b", b"", 7, None), 1, True) is None
    assert parse_publish(b"\x00\x09a/b", 1, True) is None
    assert parse_publish(b"\x00", 0, True) is None
    assert (
        parse_publish(publish_body("a/\xff", b"x", 7, b"\x00").replace(b"\xc3\xbf", b"\xff"), 1, True) is None
    )


def inbound(mid: int, size: int) -> Inbound:
    return Inbound("t/state/0", bytes(size), mid, 1, False, 1, time.monotonic())


def test_put_many_keeps_the_bounds_exactly_and_close_drops_the_rest() -> None:
    """A read pass goes in whole when it fits, else in parts (at least one message into an empty
    inbox), so neither bound is exceeded by a large pass; close drops what is not queued yet."""
    box = Inbox(max_bytes=100, max_messages=1000)
    assert box.put_many([inbound(1, 60), inbound(2, 30)])  # fits: one hand-over
    assert len(box) == 2 and box.queued_bytes == 90 and box.full_waits == 0
    done: list[bool] = []
    th = threading.Thread(target=lambda: done.append(box.put_many([inbound(3, 10), inbound(4, 80)])))
    th.start()
    th.join(0.3)
    assert (
        th.is_alive() and len(box) == 3 and box.queued_bytes == 100 and box.full_waits == 1
    )  # 3 fit, 4 waits
    assert [item.mid for _, item in box.get_batch(0.1, 8) if isinstance(item, Inbound)] == [1, 2, 3]
    th.join(2.0)
    assert done == [True] and [item.mid for _, item in box.get_batch(0.1, 8)] == [4]  # type: ignore[union-attr]
    big = Inbox(max_bytes=100, max_messages=1000)
    th = threading.Thread(target=lambda: done.append(big.put_many([inbound(5, 150), inbound(6, 1)])))
    th.start()
    th.join(0.3)
    assert th.is_alive() and len(big) == 1  # larger than the bound alone: admitted into the empty inbox
    big.get_batch(0.1, 8)
    th.join(2.0)
    assert done[-1] is True and [item.mid for _, item in big.get_batch(0.1, 8)] == [6]  # type: ignore[union-attr]
    counted = Inbox(max_bytes=1 << 20, max_messages=3)
    th = threading.Thread(
        target=lambda: done.append(counted.put_many([inbound(m, 1) for m in range(1, 8)], tag=5))
    )
    th.start()
    th.join(0.3)
    assert th.is_alive() and len(counted) == 3  # a pass of 7 against a bound of 3 messages
    counted.close()
    th.join(2.0)
    assert done[-1] is False and counted.dropped == 4 and len(counted) == 3
    assert [tag for tag, _ in counted.get_batch(0.1, 8)] == [5, 5, 5]


class Publisher:
    """A plain paho client publishing as ``client-0`` (QoS 1 or 2, optional MQTT 5 properties)."""

    def __init__(self, port: int, password: str) -> None:
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        self.c.username_pw_set("client-0", password)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def send(self, payload: bytes, qos: int = 1, props: Properties | None = None) -> None:
        self.c.publish("felix/t/server/state/0", payload, qos=qos, properties=props).wait_for_publish(10)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.mark.parametrize("manual", [True, False])
@pytest.mark.mqtt
@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_every_message_arrives_in_order_and_only_what_was_taken_is_acknowledged(
    tmp_path: Path, manual: bool
) -> None:
    """Fast-path messages and one with MQTT 5 properties (paho's path) arrive in order through
    the batch sink, at QoS 1 (the subscription's; one was published at QoS 2). ``manual``: the
    owner acks nothing, so the next connection gets every message again; it acks them with one
    ``ack_many``, and after another reconnect only the one message it did not ack (its ack named
    another connection, so it was dropped) comes back. Otherwise the link acks what the sink took, and
    nothing comes back."""
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        # A window of its own, as the server asks for (the broker holds 20 in flight otherwise).
        opts = BrokerOptions(
            "127.0.0.1", broker.port, SERVER_USER, u[SERVER_USER], connect_timeout_s=10, receive_maximum=1000
        )
        box = Inbox(1 << 20, 1000)

        def connect(fresh: bool) -> MqttLink:
            link = MqttLink(
                "srv", opts, ["felix/t/server/state/+"], box.put, manual_ack=manual, batch_sink=box.put_many
            )
            link.start(fresh=fresh)
            return link

        def drain(n: int, wait_s: float = 10.0) -> list[Inbound]:
            got: list[Inbound] = []
            deadline = time.monotonic() + wait_s
            while len(got) < n and time.monotonic() < deadline:
                got += [m for _, m in box.get_batch(0.2, 100) if isinstance(m, Inbound)]
            return got

        link = connect(fresh=True)
        pub = Publisher(broker.port, u["client-0"])
        props = Properties(PacketTypes.PUBLISH)
        props.ContentType = "x"
        try:
            for i in range(30):
                pub.send(b"m%d" % i, qos=2 if i == 20 else 1, props=props if i == 10 else None)
            first = drain(30)
            assert [m.payload for m in first] == [b"m%d" % i for i in range(30)]
            assert all(m.epoch == 1 and m.qos == 1 for m in first)
            link.close()
            link = connect(fresh=False)
            if not manual:
                assert drain(1, wait_s=1.0) == []  # the link acknowledged what the inbox took
                return
            again = drain(30)
            assert sorted(m.payload for m in again) == sorted(b"m%d" % i for i in range(30))
            link.ack_many([(m.mid, m.qos, m.epoch) for m in again])
            pub.send(b"marker")
            (marker,) = drain(1)
            assert marker.payload == b"marker"
            link.ack(marker.mid, marker.qos, marker.epoch - 1)  # another connection's ack: dropped
            wait_until(lambda: not link._client.want_write(), 5, "the acks to be written")
            link.close()
            link = connect(fresh=False)
            assert [m.payload for m in drain(2, wait_s=2.0)] == [b"marker"]  # the one not acked
        finally:
            pub.close()
            link.close()


@pytest.mark.mqtt
@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_close_lets_a_read_pass_being_handed_over_acknowledge_what_the_owner_took(tmp_path: Path) -> None:
    """The owner may hold a read pass's messages (and close because of them) before the network
    thread has queued their acks: ``close`` waits for that pass, so the next connection gets none of
    them again. The sink here holds the network thread after the owner has the messages, as a
    loaded machine may (CI once saw 12 messages come back)."""
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        # A window of its own, as the server asks for (the broker holds 20 in flight otherwise).
        opts = BrokerOptions(
            "127.0.0.1", broker.port, SERVER_USER, u[SERVER_USER], connect_timeout_s=10, receive_maximum=1000
        )
        box = Inbox(1 << 20, 1000)
        handed = threading.Event()

        def slow_sink(items: list[Inbound]) -> bool:
            taken = box.put_many(items)
            handed.set()
            time.sleep(0.5)  # the owner has them; the acks are not queued yet
            return taken

        def connect(fresh: bool, sink: Any) -> MqttLink:
            link = MqttLink("srv", opts, ["felix/t/server/state/+"], box.put, batch_sink=sink)
            link.start(fresh=fresh)
            return link

        link = connect(True, slow_sink)
        pub = Publisher(broker.port, u["client-0"])
        try:
            for i in range(5):
                pub.send(b"m%d" % i)
            got: list[Inbound] = []
            deadline = time.monotonic() + 10
            while len(got) < 5 and time.monotonic() < deadline:
                handed.wait(1.0)
                got += [m for _, m in box.get_batch(0.05, 100) if isinstance(m, Inbound)]
                if len(got) == 5:
                    link.close()  # at once, while the last pass may still be in the sink
            assert [m.payload for m in got] == [b"m%d" % i for i in range(5)]
            link = connect(False, box.put_many)
            again: list[Inbound] = []
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                again += [m for _, m in box.get_batch(0.2, 100) if isinstance(m, Inbound)]
            assert again == []
        finally:
            pub.close()
            link.close()


@pytest.mark.mqtt
@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_start_returns_once_subscribed_and_a_refused_subscription_is_an_error(tmp_path: Path) -> None:
    """``start`` waits for the SUBACK: a message published the moment it returns is delivered (it
    was lost when the link returned on the CONNACK alone), and a refused subscription is recorded
    for ``start`` to raise, not a link that silently never receives."""
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        box = Inbox(1 << 20, 1000)
        for attempt in range(5):
            opts = BrokerOptions("127.0.0.1", broker.port, SERVER_USER, u[SERVER_USER], connect_timeout_s=10)
            link = MqttLink("srv", opts, ["felix/t/server/state/+"], box.put, batch_sink=box.put_many)
            link.start(fresh=True)
            pub = Publisher(broker.port, u["client-0"])
            try:
                pub.send(b"first-%d" % attempt)
                got: list[Inbound] = []
                deadline = time.monotonic() + 10
                while not got and time.monotonic() < deadline:
                    got = [m for _, m in box.get_batch(0.2, 10) if isinstance(m, Inbound)]
                assert [m.payload for m in got] == [b"first-%d" % attempt]
            finally:
                pub.close()
                link.close()
    # Mosquitto grants any subscription and filters by ACL at delivery; a broker that refuses one
    # answers with a failure reason code in the SUBACK, which start() turns into a LinkError.
    opts = BrokerOptions("127.0.0.1", 1, "client-0", "x")
    refused = MqttLink("client-0", opts, ["felix/t/server/state/+"], box.put)
    refused._sub_mid = 7
    refused._on_subscribe(
        refused._client, None, 7, [mqtt.ReasonCode(PacketTypes.SUBACK, identifier=0x87)], None
    )
    assert refused._subscribed.is_set() and refused._sub_refused == "Not authorized"
