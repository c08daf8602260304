"""The transport seam of a deployment: what the server and the client host need from a link.

Modelled on Flower's ``Grid`` (``InMemoryGrid`` / ``GrpcGrid``): the shells talk to a link in
terms of channels and client ids (``felix.deploy.channels``), never a transport's own
addressing, and a transport is chosen by name (``felix serve/client --transport NAME``,
``ServeOptions.transport`` / ``ClientOptions.transport``; ``mqtt`` by default). A transport is one
file that implements :class:`Transport`, keeps its options model beside it (a dataclass the
shells read as :class:`LinkOptions`; the CLI builds it from ``--link KEY=VALUE`` with
:func:`link_options`) and registers an instance in :data:`TRANSPORTS` (the registry class of every
component kind, ``felix.core.registry``).

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

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from pydantic import TypeAdapter, ValidationError

from felix.config.base import unknown_key
from felix.core.registry import Registry
from felix.deploy.channels import Address, Channel
from felix.deploy.link import Connected


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
    (MQTT: the topic), for logs only. ``received_at``: when the transport received it
    (``time.monotonic()``; 0.0 where it does not say), so that a message's delay splits into the
    part before the server had it and its wait in the inbox."""

    address: Address | None
    payload: bytes
    ack: Ack
    origin: str
    received_at: float = 0.0


Item = Delivery | Connected
Sink = Callable[[Item], None]
BatchSink = Callable[[list[Delivery]], bool]


class LinkOptions(Protocol):
    """What the shells read of a transport's options; the rest (a broker's address, TLS files,
    keepalives) is the transport's own, in its options model."""

    @property
    def connect_timeout_s(self) -> float:
        """How long a link may take to connect and set up its deliveries."""
        ...

    @property
    def secure(self) -> bool:
        """Whether the link is encrypted and the peer verified (MQTT: TLS)."""
        ...

    def describe(self) -> str:
        """Where the link connects, for logs, metrics and the summary (MQTT: ``HOST:PORT``)."""
        ...

    def with_login(self, username: str | None, password: str | None) -> Any:
        """The same options with a client's (or the server's) login; a transport without logins
        returns them unchanged."""
        ...


class ServerLink(Protocol):
    """The server's end: deliveries from every client on the inbound channels."""

    @property
    def connected(self) -> bool: ...

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        """Connect (bounded); ``fresh``: discard what the transport kept for an earlier server.
        May return before ``ready``: a resumed server drains its backlog meanwhile."""

    def ready(self) -> bool:
        """Whether deliveries are set up (MQTT: the SUBACK); raises LinkError if refused, or once
        the link failed for good (``felix.deploy.link_process``: its process gone). The server
        asks every turn."""
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
    options: Any  # the transport's own options model (checked by resolve)
    receive_maximum: int | None  # deliveries the server may hold unacknowledged
    sink: Sink
    batch_sink: BatchSink


@dataclass(frozen=True)
class ClientLinkArgs:
    run_id: str
    client: int
    options: Any  # the transport's own options model, with this client's login
    sink: Sink
    batch_sink: BatchSink


class Transport(Protocol):
    """Builds the links of one kind of transport from its options model (``options``)."""

    @property
    def options(self) -> type[Any]:
        """Its options model: a dataclass that implements :class:`LinkOptions`."""
        ...

    def server_link(self, args: ServerLinkArgs) -> ServerLink: ...

    def client_link(self, args: ClientLinkArgs) -> ClientLink: ...


#: The transports by name; the built-in ones' modules are imported on the first lookup. A
#: transport registers an instance (its links share what it holds): ``TRANSPORTS.register(name)(t)``.
TRANSPORTS: Registry[Transport] = Registry(
    "transport", modules=("felix.deploy.mqtt_transport", "felix.deploy.memory_transport"), key="transport"
)


def get(name: str) -> Transport:
    """The transport registered as ``name``."""
    return cast(Transport, TRANSPORTS.entry(name).factory)  # an instance, registered as itself


def resolve(name: str, options: object) -> Transport:
    """The transport ``name``, once ``options`` is checked to be its options model."""
    transport = get(name)
    if not isinstance(options, transport.options):
        raise TypeError(
            f"transport {name!r} takes {transport.options.__name__}, not {type(options).__name__}"
        )
    return transport


def link_options(name: str, settings: Mapping[str, object]) -> LinkOptions:
    """Transport ``name``'s options from ``KEY=VALUE`` settings (the CLI's ``--link`` and its
    shorthands), checked against its options model: one line for an unknown key or a bad value."""
    model = get(name).options
    known = [f.name for f in dataclasses.fields(model)]
    for key in settings:
        if key not in known:
            raise ValueError(f"transport {name!r}: option {key!r}: {unknown_key(key, known)}")
    try:
        opts: LinkOptions = TypeAdapter(model).validate_python(dict(settings))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"transport {name!r}: " + (f"option {where!r}: " if where else "") + msg) from None
    return opts
