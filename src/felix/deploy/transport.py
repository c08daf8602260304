"""The transport seam of a deployment: what the server and the client host need from a link.

Modelled on Flower's ``Grid`` (``InMemoryGrid`` / ``GrpcGrid``): the shells talk to a link in
terms of channels and client ids (``felix.deploy.channels``), never a transport's own
addressing, and a transport is chosen by name (``ServeOptions.transport`` /
``ClientOptions.transport``; ``mqtt`` by default). A transport is one file that implements
:class:`Transport` and registers itself with :func:`register`.

A link hands what it receives to its owner's sinks, from any thread: a :class:`Connected` notice
per (re)connection, and :class:`Delivery` items (one at a time to ``sink`` or a list at once to
``batch_sink``, which returns False when the owner dropped them while closing). Each delivery
carries the :class:`Address` its transport vouches for and an :class:`Ack` handle: the server
acknowledges a message only once its effect is durable (exactly once across restarts), and acks
of an older connection (``Ack.epoch``) mean nothing to a newer one of the same shard (``Ack.shard``,
``Connected.shard``: a link may span several brokers, each with its own connections). The shells never block on a
link except in ``start`` and ``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from felix.deploy.channels import Address, Channel
from felix.deploy.link import BrokerOptions, Connected


@dataclass(frozen=True, slots=True)
class Ack:
    """How to acknowledge one delivery: the transport's token for it, whether it wants an ack
    (``qos`` > 0) and the connection it arrived on."""

    token: int
    qos: int
    epoch: int
    shard: int = 0  # the broker it came through, in a sharded deployment (``felix.deploy.shards``)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One inbound message. ``address`` is None when the transport could not place it (MQTT: a
    topic outside the scheme); ``origin`` is the transport's own name for where it came from
    (MQTT: the topic), for logs only."""

    address: Address | None
    payload: bytes
    ack: Ack
    origin: str


Item = Delivery | Connected
Sink = Callable[[Item], None]
BatchSink = Callable[[list[Delivery]], bool]


class ServerLink(Protocol):
    """The server's end: deliveries from every client on the inbound channels."""

    @property
    def connected(self) -> bool: ...

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        """Connect (bounded); ``fresh``: discard what the transport kept for an earlier server.
        May return before ``ready``: a resumed server drains its backlog meanwhile."""

    def ready(self) -> bool:
        """Whether deliveries are set up (MQTT: the SUBACK); raises LinkError if refused."""
        ...

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        """To one client (``Channel.TASK``), or to all (``Channel.STATUS``, kept for late joiners)."""

    def ack(self, acks: list[Ack]) -> None:
        """Acknowledge deliveries (ones of an older connection are ignored)."""

    def close(self, timeout: float = 5.0) -> None: ...

    def connections(self) -> list[tuple[str, bool]]:
        """Each shard's broker (as the transport names it) and whether it is connected, in shard order."""
        ...


class ClientLink(Protocol):
    """One client's end: its tasks and the server's status in, its messages out."""

    @property
    def connected(self) -> bool: ...

    def set_will(self, channel: Channel, builder: Callable[[int], bytes], delay_s: int) -> None:
        """The message the transport sends for the client if its connection is lost
        (``builder(epoch)``, rebuilt per connection); a transport that cannot lose one ignores it."""

    def start(self, fresh: bool) -> None: ...

    def send(self, channel: Channel, payload: bytes) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


@dataclass(frozen=True)
class ServerLinkArgs:
    run_id: str
    broker: BrokerOptions
    receive_maximum: int | None  # deliveries the server may hold unacknowledged
    sink: Sink
    batch_sink: BatchSink


@dataclass(frozen=True)
class ClientLinkArgs:
    run_id: str
    client: int
    broker: BrokerOptions  # with this client's login
    sink: Sink
    batch_sink: BatchSink


class Transport(Protocol):
    """Builds the links of one kind of transport."""

    def server_link(self, args: ServerLinkArgs) -> ServerLink: ...

    def client_link(self, args: ClientLinkArgs) -> ClientLink: ...


_TRANSPORTS: dict[str, Transport] = {}


def register(name: str, transport: Transport) -> None:
    """Make ``transport`` available as ``name`` (a name registered twice is an error)."""
    if name in _TRANSPORTS:
        raise ValueError(f"transport {name!r} is already registered")
    _TRANSPORTS[name] = transport


def get(name: str) -> Transport:
    """The transport registered as ``name`` (the built-in ones register on first use)."""
    from felix.deploy import memory_transport, mqtt_transport  # noqa: F401 - they register

    try:
        return _TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(_TRANSPORTS))}") from None
