"""Sharded brokers (``felix.deploy.shards``): the client-to-shard hash, the broker list and the
per-shard credentials (no broker needed; the run over three brokers is tests/test_mqtt_shards.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from felix.deploy import security
from felix.deploy.channels import Channel
from felix.deploy.cli import main as deploy_main
from felix.deploy.link import BrokerOptions, Connected
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.shards import ShardedServerLink, client_broker, shard_of, shards_of
from felix.deploy.topics import SERVER_USER, client_user
from felix.deploy.transport import Ack


def test_shard_of_is_one_function_in_python_and_numpy_and_spreads_evenly() -> None:
    ids = np.arange(30_000)
    for n in (1, 2, 3, 4, 7):
        vec = shards_of(ids, n)
        assert [shard_of(int(c), n) for c in ids[:2000]] == vec[:2000].tolist()
        counts = np.bincount(vec, minlength=n)
        assert counts.min() > 0.9 * len(ids) / n, (n, counts)  # balanced within 10%
    big = np.array([2**40 + 5, 2**62 + 1])
    assert shards_of(big, 5).tolist() == [shard_of(int(c), 5) for c in big]


def test_a_client_gets_its_shards_broker_and_the_list_is_checked() -> None:
    addresses = BrokerOptions.parse_addresses("127.0.0.1:1001, 127.0.0.1:1002,localhost:1003")
    opts = BrokerOptions("127.0.0.1", 1001, shards=tuple(addresses))
    assert opts.address == "127.0.0.1:1001,127.0.0.1:1002,localhost:1003"
    for cid in range(50):
        b = client_broker(opts, cid)
        assert (b.host, b.port) == addresses[shard_of(cid, 3)] and b.shards == ()
    with pytest.raises(ValueError, match="twice"):
        BrokerOptions.parse_addresses("127.0.0.1:1,127.0.0.1:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        BrokerOptions.parse_addresses("127.0.0.1:1,nope")


def test_each_shard_holds_the_server_and_only_its_own_clients(tmp_path: Path) -> None:
    assert (
        deploy_main(
            [
                "mqtt-credentials",
                "--clients",
                "40",
                "--out",
                str(tmp_path),
                "--listen",
                "127.0.0.1:7001,127.0.0.1:7002",
            ]
        )
        == 0
    )
    users = security.load_credentials(tmp_path / "credentials.json")
    assert len(users) == 41
    seen: list[str] = []
    for k in range(2):
        folder = tmp_path / f"shard-{k}"
        names = [line.split(":", 1)[0] for line in (folder / "passwd").read_text().splitlines()]
        assert SERVER_USER in names
        mine = [n for n in names if n != SERVER_USER]
        assert mine == sorted(client_user(c) for c in range(40) if shard_of(c, 2) == k)
        acl = (folder / "acl").read_text()
        assert (
            all(f"user {n}\n" in acl for n in mine) and acl.count("\nuser ") == len(mine) + 1
        )  # and the server
        assert f"listener {7001 + k} 127.0.0.1" in (folder / "mosquitto.conf").read_text()
        seen += mine
    assert sorted(seen) == sorted(u for u in users if u != SERVER_USER)


class _FakeLink:
    """A shard's link that records what it was asked to send and acknowledge."""

    def __init__(self) -> None:
        self.sent: list[tuple[Channel, int | None]] = []
        self.acked: list[Ack] = []

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        self.sent.append((channel, client))

    def ack(self, acks: list[Ack]) -> None:
        self.acked += acks


def test_the_sharded_link_routes_tasks_and_acks_to_their_shard_and_status_to_all() -> None:
    link = ShardedServerLink.__new__(ShardedServerLink)
    fakes = [_FakeLink() for _ in range(3)]
    link.links = fakes  # type: ignore[assignment]
    for cid in range(30):
        link.send(Channel.TASK, cid, b"t")
    link.send(Channel.STATUS, None, b"s")
    acks = [Ack(token=i, qos=1, epoch=1, shard=i % 3) for i in range(9)]
    link.ack(acks)
    for k, fake in enumerate(fakes):
        assert fake.sent == [(Channel.TASK, c) for c in range(30) if shard_of(c, 3) == k] + [
            (Channel.STATUS, None)
        ]
        assert fake.acked == [a for a in acks if a.shard == k]


def test_a_shards_reconnect_voids_only_that_shards_pending_acks(tmp_path: Path) -> None:
    """The broker of the reconnected shard redelivers what it had not been acknowledged; the other
    shards' connections did not change, and their pending acks must still be sent (or those brokers
    would hold the messages in flight forever, filling the server's window)."""
    from felix.deploy.server import ServeOptions, Server
    from felix.engine.setup import resolve_config

    cfg = resolve_config(None, None, {"partition": {"num_clients": 4}, "dataset": {"name": "digits"}})
    server = Server(cfg, ServeOptions(MemoryOptions(), run_id="t", transport="memory"))
    pending = [(Ack(token=i, qos=1, epoch=1, shard=i % 2), 10) for i in range(6)]
    server._pending_acks = list(pending)
    server._on_connected(Connected(epoch=2, session_present=True, shard=1))
    assert server._pending_acks == [p for p in pending if p[0].shard == 0]
    assert server._pending_bytes == 30 and server.stats.reconnects == 1


def test_closing_a_link_whose_last_publish_found_no_connection_does_not_raise() -> None:
    """A shard's broker down at the end of a run: the server's link to it published its status while
    disconnected, and closing it raised paho's 'Message publish failed' from the close thread."""
    from felix.deploy.link import MqttLink

    link = MqttLink("x", BrokerOptions(port=1, connect_timeout_s=1), [], lambda item: None)
    link.publish("felix/t/server/status", b"finished")
    link.close(timeout=0.2)
    assert not link.connected
