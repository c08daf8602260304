"""The in-memory transport: server and clients of one process share a broker object.

Flower's ``InMemoryGrid`` counterpart, for tests and single-process runs: no sockets, nothing
survives the process. The broker keeps, per run, the server's sinks, each client's sinks, what
was sent to an end not yet attached (a session's queue) and the last STATUS (for late joiners,
as MQTT's retained message). A message is handed to the receiver's sink on the sender's thread,
outside the broker's lock (a full inbox makes the sender wait: back-pressure, as TCP's). Its
address is the one the sender's link was built for, so no client can speak for another. Acks
are accepted and ignored (nothing is redelivered), and a will is never sent (a link never
drops).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from felix.deploy.channels import Address, Channel
from felix.deploy.link import Connected, LinkError
from felix.deploy.transport import (
    TRANSPORTS,
    Ack,
    BatchSink,
    ClientLinkArgs,
    Delivery,
    ServerLinkArgs,
    Sink,
)


@dataclass(frozen=True)
class MemoryOptions:
    """The in-memory transport's options: nothing to connect to, nothing to log in with."""

    connect_timeout_s: float = 5.0

    @property
    def secure(self) -> bool:
        return False  # nothing leaves the process

    def describe(self) -> str:
        return "in-memory"

    def with_login(self, username: str | None, password: str | None) -> MemoryOptions:
        return self


@dataclass
class _End:
    """One end of a run: its sinks while attached, and what waits for it until then."""

    batch_sink: BatchSink | None = None
    queued: list[Delivery] = field(default_factory=list)


@dataclass
class _Run:
    server: _End = field(default_factory=_End)
    clients: dict[int, _End] = field(default_factory=dict)
    status: bytes | None = None


class InMemoryBroker:
    """Thread-safe message passing between the links of one process, runs kept apart by run id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._tokens = itertools.count(1)

    def _run(self, run_id: str) -> _Run:
        return self._runs.setdefault(run_id, _Run())

    def _client(self, run_id: str, cid: int) -> _End:
        return self._run(run_id).clients.setdefault(cid, _End())

    def _delivery(self, address: Address, payload: bytes, origin: str) -> Delivery:
        return Delivery(address, payload, Ack(next(self._tokens), 1, 1), origin)

    def attach(self, run_id: str, cid: int | None, sink: BatchSink, fresh: bool) -> _End:
        """Attach the server (``cid`` None) or a client of ``run_id`` and hand it what waits for it:
        a client first the kept STATUS, then what was queued while it was away (``fresh``: the
        server drops that)."""
        with self._lock:
            run = self._run(run_id)
            end = run.server if cid is None else self._client(run_id, cid)
            if end.batch_sink is not None:
                raise LinkError(
                    f"run {run_id!r}: {'the server' if cid is None else f'client {cid}'} is attached already"
                )
            if fresh and cid is None:
                end.queued.clear()
            backlog = end.queued
            if cid is not None and run.status is not None:
                backlog = [
                    self._delivery(Address(Channel.STATUS, cid), run.status, f"{run_id}/status"),
                    *backlog,
                ]
            end.batch_sink, end.queued = sink, []
        if backlog:
            sink(backlog)
        return end

    def detach(self, end: _End) -> None:
        with self._lock:
            end.batch_sink = None

    def _put(self, end: _End, item: Delivery) -> None:
        with self._lock:
            sink = end.batch_sink
            if sink is None:
                end.queued.append(item)
        if sink is not None:
            sink([item])

    def to_server(self, run_id: str, channel: Channel, cid: int, payload: bytes) -> None:
        item = self._delivery(Address(channel, cid), payload, f"{run_id}/{channel.value}/{cid}")
        with self._lock:
            end = self._run(run_id).server
        self._put(end, item)

    def to_clients(self, run_id: str, channel: Channel, cid: int | None, payload: bytes) -> None:
        if channel is Channel.STATUS:
            with self._lock:
                run = self._run(run_id)
                run.status = payload
                ends = list(run.clients.items())
            for c, end in ends:
                self._put_if_attached(end, self._delivery(Address(channel, c), payload, f"{run_id}/status"))
            return
        assert channel is Channel.TASK and cid is not None, (channel, cid)
        with self._lock:
            end = self._client(run_id, cid)
        self._put(end, self._delivery(Address(channel, cid), payload, f"{run_id}/task/{cid}"))

    def _put_if_attached(self, end: _End, item: Delivery) -> None:
        with self._lock:
            sink = end.batch_sink
        if sink is not None:  # a client attaching later gets the kept status instead
            sink([item])


class _Link:
    """What both ends share: a (re)connection notice to the owner, then the backlog."""

    def __init__(self, broker: InMemoryBroker, sink: Sink, batch_sink: BatchSink) -> None:
        self.broker = broker
        self.sink = sink
        self.batch_sink = batch_sink
        self._end: _End | None = None
        self._epoch = 0

    @property
    def connected(self) -> bool:
        return self._end is not None

    def _attach(self, run_id: str, cid: int | None, fresh: bool) -> None:
        self._epoch += 1
        self.sink(Connected(self._epoch, False))
        self._end = self.broker.attach(run_id, cid, self.batch_sink, fresh)

    def close(self, timeout: float = 5.0) -> None:
        if self._end is not None:
            self.broker.detach(self._end)
            self._end = None


class InMemoryServerLink(_Link):
    def __init__(self, broker: InMemoryBroker, args: ServerLinkArgs) -> None:
        super().__init__(broker, args.sink, args.batch_sink)
        self.run_id = args.run_id

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        self._attach(self.run_id, None, fresh)

    def ready(self) -> bool:
        return self._end is not None

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        self.broker.to_clients(self.run_id, channel, client, payload)

    def ack(self, acks: list[Ack]) -> None:
        """Nothing to do: the in-memory broker never redelivers."""

    def connections(self) -> list[tuple[str, bool]]:
        return [("memory", self.connected)]


class InMemoryClientLink(_Link):
    def __init__(self, broker: InMemoryBroker, args: ClientLinkArgs) -> None:
        super().__init__(broker, args.sink, args.batch_sink)
        self.run_id = args.run_id
        self.client = args.client

    def set_will(self, channel: Channel, builder: Callable[[int], bytes], delay_s: int) -> None:
        """Never sent: an in-memory link does not lose its connection."""

    def start(self, fresh: bool) -> None:
        self._attach(self.run_id, self.client, fresh)

    def send(self, channel: Channel, payload: bytes) -> None:
        self.broker.to_server(self.run_id, channel, self.client, payload)


@dataclass
class InMemoryTransport:
    """Links through one shared :class:`InMemoryBroker` (a process-wide one by default)."""

    broker: InMemoryBroker = field(default_factory=InMemoryBroker)
    options: ClassVar[type[MemoryOptions]] = MemoryOptions

    def server_link(self, args: ServerLinkArgs) -> InMemoryServerLink:
        return InMemoryServerLink(self.broker, args)

    def client_link(self, args: ClientLinkArgs) -> InMemoryClientLink:
        return InMemoryClientLink(self.broker, args)


TRANSPORTS.register("memory")(InMemoryTransport())
