"""The server's link keeps its connection while its inbox is full (``felix.deploy.blocked``).

The collapse at scale: at ~10,000 tier messages a second the server's inbox stayed full, the
link's network thread waited on it longer than the keep-alive, the broker dropped the connection,
and each reconnect redelivered everything unacknowledged, so the loop handled copies instead of
new messages. Here the same thing at small scale: a flood against an inbox of 20 messages whose
owner takes nothing for several keep-alives. The link must stay connected (one connection, no
redelivery) and then hand over every message once.
"""

from __future__ import annotations

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
        # Keep-alive 1 s: the broker drops a connection silent for 1.5 s.
        opts = BrokerOptions(
            "127.0.0.1",
            broker.port,
            SERVER_USER,
            u[SERVER_USER],
            keepalive_s=1,
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
            assert link.connected and link.epoch == 1, "the link reconnected while its inbox was full"
            assert [m.payload[:5] for m in got] == [b"m%04d" % i for i in range(N)]  # each once, in order
            assert link.upkeeps >= 10
        finally:
            pub.disconnect()
            pub.loop_stop()
            link.close()
