"""The server's link keeps its connection while its inbox is full (``felix.deploy.blocked``).

The collapse at scale: at ~10,000 tier messages a second the server's inbox stayed full, the
link's network thread waited on it longer than the keep-alive, the broker dropped the connection,
and each reconnect redelivered everything unacknowledged, so the loop handled copies instead of
new messages. Here the same thing at small scale: a flood against an inbox of 20 messages whose
owner takes nothing for several keep-alives. The link must stay connected (one connection, no
redelivery) and then hand over every message once.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker, find_mosquitto
from mqtt_support import users

from felix.deploy.blocked import keeping_alive
from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions, Inbound, MqttLink
from felix.deploy.topics import SERVER_USER
from felix.deploy.transport import Ack, Delivery

N = 300


def test_a_put_waiting_for_room_runs_its_links_upkeep() -> None:
    box = Inbox(1 << 20, 1)
    box.put_many([Delivery(None, b"x", Ack(1, 1, 1), "t")])
    calls: list[float] = []

    def put() -> None:
        with keeping_alive(lambda: calls.append(time.monotonic())):
            box.put_many([Delivery(None, b"y", Ack(2, 1, 1), "t")])

    th = threading.Thread(target=put, daemon=True)
    th.start()
    time.sleep(1.0)
    assert th.is_alive() and len(calls) >= 3  # the put still waits (the bound holds), its upkeep runs
    box.get_batch(0.1, 10)
    th.join(2.0)
    assert not th.is_alive()


@pytest.mark.mqtt
@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_a_full_inbox_does_not_cost_the_link_its_connection(tmp_path: Path) -> None:
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        # Keep-alive 2 s: the broker drops a connection silent for 3 s (counted in whole seconds:
        # a keep-alive of 1 s leaves a connection that is served on time too little margin on a
        # loaded machine), so the 8 s below are more than twice that.
        opts = BrokerOptions(
            "127.0.0.1",
            broker.port,
            SERVER_USER,
            u[SERVER_USER],
            keepalive_s=2,
            connect_timeout_s=10,
            receive_maximum=1000,
        )
        box = Inbox(1 << 20, 20)
        link = MqttLink(
            "srv", opts, ["felix/t/server/state/+"], box.put, manual_ack=True, batch_sink=box.put_many
        )
        link.start(fresh=True)
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        pub.username_pw_set("client-0", u["client-0"])
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        try:
            infos = [
                pub.publish("felix/t/server/state/0", b"m%04d" % i + bytes(1000), qos=1) for i in range(N)
            ]
            for info in infos:
                info.wait_for_publish(10)
            # The owner is behind: the inbox stays full for 8 s (Mosquitto checks keep-alives every few
            # seconds, and drops a connection silent for 1.5 keep-alives).
            time.sleep(8.0)
            got: list[Inbound] = []
            deadline = time.monotonic() + 20
            while len(got) < N + 5 and time.monotonic() < deadline:
                batch = [m for _, m in box.get_batch(0.5, 100) if isinstance(m, Inbound)]
                link.ack_many([(m.mid, m.qos, m.epoch) for m in batch])
                got += batch
                if len(got) >= N and not batch:
                    break
            time.sleep(2.0)  # a connection the broker dropped is found dead once its bytes are read
            got += [m for _, m in box.get_batch(0.5, 1000) if isinstance(m, Inbound)]
            assert link.connected and link.epoch == 1, (
                f"the link reconnected while its inbox was full; the broker's log:\n{broker._log_tail()}"
            )
            assert [m.payload[:5] for m in got] == [b"m%04d" % i for i in range(N)]  # each once, in order
            assert link.upkeeps >= 10
        finally:
            pub.disconnect()
            pub.loop_stop()
            link.close()


@pytest.mark.parametrize(("quiet_s", "pings"), [(0.9, 0), (1.1, 1), (2.5, 1)])
def test_a_waiting_links_upkeep_pings_every_half_keepalive(quiet_s: float, pings: int) -> None:
    """A blocked link pings once half its keep-alive (2 s) has passed without a packet out, not
    at the full keep-alive as paho does, and then counts the ping as the last packet out."""
    link = MqttLink(
        "srv", BrokerOptions("127.0.0.1", 1, SERVER_USER, "pw", keepalive_s=2), [], lambda m: None
    )
    c = link._client
    a, b = socket.socketpair()
    sent: list[float] = []
    try:
        c._sock = a
        c._keepalive = 2
        c._last_msg_out = mqtt.time_func() - quiet_s
        c._send_pingreq = lambda: sent.append(mqtt.time_func()) or mqtt.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
        c._check_keepalive = lambda: None  # type: ignore[method-assign]
        c.loop_write = lambda: mqtt.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
        link._upkeep()
        assert len(sent) == pings and link.upkeeps == 1
        assert (mqtt.time_func() - c._last_msg_out < 0.5) == bool(pings)
    finally:
        c._sock = None
        a.close()
        b.close()
