"""Sharded brokers: one federation over several MQTT brokers, each client on one of them.

One broker holds a bounded number of connections (open files per process, ports per source
address, its single thread); a population beyond that spreads over N brokers, as MQTT brokers are
meant to be scaled. ``--broker A:1,B:2,...`` lists them in shard order (``BrokerOptions.shards``);
every process derives a client's broker from its id with :func:`shard_of`, a fixed integer hash
(splitmix64's finaliser) that needs no table and no coordination and spreads consecutive ids
evenly, so the server, the clients and ``felix mqtt-credentials`` (which gives each broker the
logins and ACL of its own clients only) always agree.

The server's end, :class:`ShardedServerLink`, is a ``ServerLink`` over one MQTT link per broker:
the server protocol and the orchestrator do not know there are several. Deliveries and
connection notices carry their shard (``Ack.shard``, ``Connected.shard``) so that each
acknowledgement goes back to the broker, and the connection, that delivered the message; a
shard's reconnect voids only that shard's pending acknowledgements. Exactly-once holds per
broker as it does for one: a message is acknowledged to its broker only after the checkpoint
that holds its effect, and a broker that restarts redelivers what was not acknowledged. A broker
that dies takes only its own clients away; the other shards keep serving, and its clients and
the server's link reconnect when it returns. Start-up needs every broker (a fresh start clears
the server's session on each), within the connect timeout.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from felix.deploy.channels import Channel
from felix.deploy.link import BrokerOptions, LinkError
from felix.deploy.transport import Ack, ServerLinkArgs

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def shard_of(client: int, shards: int) -> int:
    """The shard (0 .. ``shards``-1) of client id ``client``: stable across processes and runs."""
    z = (client + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return (z ^ (z >> 31)) % shards


def shards_of(clients: np.ndarray, shards: int) -> np.ndarray:
    """:func:`shard_of` of many ids at once (numpy's uint64 arithmetic wraps as the mask does)."""
    z = np.asarray(clients, dtype=np.int64).astype(np.uint64) + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return ((z ^ (z >> np.uint64(31))) % np.uint64(shards)).astype(np.int64)


def shard_options(broker: BrokerOptions) -> list[BrokerOptions]:
    """One ``BrokerOptions`` per shard (host and port its broker's, the rest shared)."""
    if not broker.shards:
        return [broker]
    return [dataclasses.replace(broker, host=h, port=p, shards=()) for h, p in broker.shards]


def client_broker(broker: BrokerOptions, client: int) -> BrokerOptions:
    """The options of the one broker ``client`` connects to."""
    return shard_options(broker)[shard_of(client, len(broker.shards))] if broker.shards else broker


class ShardedServerLink:
    """The server's end over one ``MqttServerLink`` per broker (in shard order)."""

    def __init__(self, args: ServerLinkArgs) -> None:
        from felix.deploy.mqtt_transport import MqttServerLink

        self.links = [
            MqttServerLink(dataclasses.replace(args, options=b), shard=k)
            for k, b in enumerate(shard_options(args.options))
        ]

    @property
    def connected(self) -> bool:
        """Every shard is connected."""
        return all(link.connected for link in self.links)

    def connections(self) -> list[tuple[str, bool]]:
        return [c for link in self.links for c in link.connections()]

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        """Connect to every broker in turn (each bounded by the connect timeout); one that cannot
        be reached closes the others and raises its LinkError, naming the shard."""
        for k, link in enumerate(self.links):
            try:
                link.start(fresh, stop)
            except LinkError as exc:
                for started in self.links[:k]:
                    started.close(timeout=1.0)
                raise LinkError(f"shard {k} of {len(self.links)}: {exc}") from None

    def ready(self) -> bool:
        return all(link.ready() for link in self.links)

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        if client is None:  # STATUS: every shard's clients
            for link in self.links:
                link.send(channel, None, payload)
        else:
            self.links[shard_of(client, len(self.links))].send(channel, client, payload)

    def ack(self, acks: list[Ack]) -> None:
        by_shard: dict[int, list[Ack]] = {}
        for a in acks:
            by_shard.setdefault(a.shard, []).append(a)
        for k, items in by_shard.items():
            self.links[k].ack(items)

    def close(self, timeout: float = 5.0) -> None:
        """Close every shard's link side by side, so the whole takes ``timeout`` at most, not N times it."""
        threads = [threading.Thread(target=link.close, args=(timeout,), daemon=True) for link in self.links]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 2.0)
