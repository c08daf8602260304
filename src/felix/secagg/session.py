"""One group run end to end in one process: the server's and the members' state machines with
every message passed through its wire encoding, so the bytes are counted exactly as they would
travel. The simulator drives its groups through this (with the dropouts its trace decides), the
tests through random dropout patterns, and the speed benchmark through it too.

``drop_at[m]`` names the stage at which member m goes silent (it sends nothing from that stage
on): ``keys``, ``shares``, ``masked`` or ``unmask``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from felix.secagg.client import SecAggClient
from felix.secagg.graph import GroupLayout
from felix.secagg.messages import KeysBroadcast, Message, Setup, SharesForward, UnmaskRequest, decode, encode
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import SecAggRefusal
from felix.secagg.server import SecAggServer

STAGES = ("keys", "shares", "masked", "unmask")


@dataclass
class StageTraffic:
    """One exchange of one group: the bytes each member received (``down``) and sent (``up``), and
    the members that were sent a message and never answered (``silent``), and whether the answers
    in sufficed for the group to finish (``sufficient``: the server may close such a stage a grace
    after they are in), for the simulator's link cost (:mod:`felix.secagg.latency`)."""

    stage: str
    down: dict[int, int] = field(default_factory=dict)
    up: dict[int, int] = field(default_factory=dict)
    silent: list[int] = field(default_factory=list)
    sufficient: bool = False


@dataclass
class Traffic:
    """Bytes and round trips of one group: ``up`` (clients to server) and ``down`` per member,
    and ``round_trips``, the stages the group went through; ``stages``, the exchanges one by one
    (one group's: :meth:`add` sums bytes and leaves them out)."""

    up: dict[int, int] = field(default_factory=dict)
    down: dict[int, int] = field(default_factory=dict)
    round_trips: int = 0
    client_seconds: float = 0.0
    server_seconds: float = 0.0
    stages: list[StageTraffic] = field(default_factory=list)

    def add(self, other: Traffic) -> None:
        for src, dst in ((other.up, self.up), (other.down, self.down)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v
        self.round_trips = max(self.round_trips, other.round_trips)

    @property
    def total(self) -> int:
        return sum(self.up.values()) + sum(self.down.values())


Tamper = Callable[[int, bytes], bytes]


def run_group(
    layout: GroupLayout,
    quantizer: Quantizer,
    updates: Mapping[int, tuple[float, np.ndarray]],
    drop_at: Mapping[int, str] | None = None,
    tamper: Tamper | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[SecAggServer, Traffic]:
    """Run ``layout``'s group on ``updates`` (member -> (weight in [0, 1], delta)). ``tamper``
    may rewrite a client's outgoing payload (hostile-client tests); refused messages are in the
    server's ``refusals``. ``clock`` (the benchmark's CPU clock; none in the simulator) splits the
    time spent into the members' and the server's work."""
    drop_at = drop_at or {}
    length = next(iter(updates.values()))[1].size
    server = SecAggServer(layout, quantizer, length)
    clients = {m: SecAggClient(m) for m in layout.members}
    traffic = Traffic({m: 0 for m in layout.members}, {m: 0 for m in layout.members})
    inbox: dict[int, Message] = dict(server.setup())
    for stage in STAGES:
        traffic.round_trips += 1
        exchange = StageTraffic(stage)
        traffic.stages.append(exchange)
        for m, msg in inbox.items():
            raw = encode(msg)
            traffic.down[m] += len(raw)
            exchange.down[m] = len(raw)
            exchange.silent.append(m)
            if m in drop_at and STAGES.index(drop_at[m]) <= STAGES.index(stage):
                continue
            t0 = clock() if clock else 0.0
            try:
                reply = _answer(clients[m], decode(raw), updates)
            except SecAggRefusal:
                continue  # the client refuses and takes no further part
            finally:
                if clock:
                    traffic.client_seconds += clock() - t0
            if reply is None:
                continue
            if tamper is not None:
                reply = tamper(m, reply)
            traffic.up[m] += len(reply)
            exchange.up[m] = len(reply)
            exchange.silent.pop()
            t0 = clock() if clock else 0.0
            try:
                server.receive(decode(reply))
            except SecAggRefusal as exc:
                if not server.refusals or server.refusals[-1][1] is not exc:
                    server.refusals.append((m, exc))  # did not decode: refused before the server saw it
            if clock:
                traffic.server_seconds += clock() - t0
        exchange.sufficient = server.sufficient()
        t0 = clock() if clock else 0.0
        inbox = dict(server.advance())
        if clock:
            traffic.server_seconds += clock() - t0
        if server.done:
            break
    return server, traffic


def _answer(
    client: SecAggClient,
    msg: Message,
    updates: Mapping[int, tuple[float, np.ndarray]],
) -> bytes | None:
    if isinstance(msg, Setup):
        return encode(client.on_setup(msg))
    if isinstance(msg, KeysBroadcast):
        return encode(client.on_keys(msg))
    if isinstance(msg, SharesForward):
        client.on_shares(msg)
        weight, delta = updates[client.client_id]
        return encode(client.masked(weight, delta))
    if isinstance(msg, UnmaskRequest):
        return encode(client.on_unmask(msg))
    return None


__all__ = ["STAGES", "StageTraffic", "Traffic", "run_group"]
