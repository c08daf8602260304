"""Heavy headers and the per-login cost budget (felix.deploy.wire, felix.deploy.protocol).

The attack: 64 KiB headers of 32k integers at 1,000 a second from one login each cost the server
5-12 ms to refuse (700x a normal message), and the per-login budget, counted in messages per
config second, let them all through. Now the header's size (sized to the run's classes) and its
brackets are checked on the raw bytes before parsing, and each login's decode time and payload
bytes are charged against a budget per wall second, whatever the time scale.
"""

from __future__ import annotations

import json
import time

from mqtt_support import At

from felix.core.refusals import Refusal
from felix.core.types import Tier
from felix.deploy import wire
from felix.deploy.protocol import Accepted, ProtocolLimits, Refused, ServerProtocol

RUN = "r1"


class Nobody:
    @property
    def plans(self) -> dict[int, tuple[int, ...]]:
        return {}

    def is_registered(self, cid: int) -> bool:
        return False

    def held_task(self, cid: int) -> int | None:
        return None

    def late_task(self, cid: int) -> int | None:
        return None


def protocol(cpu_share: float | None = 0.05, bytes_per_s: float | None = None) -> ServerProtocol:
    limits = ProtocolLimits(
        num_clients=4,
        num_classes=10,
        partition_sizes=[30] * 4,
        max_bytes=1 << 20,
        aux_spec={},
        cpu_share=cpu_share,
        cpu_burst_s=0.25,
        bytes_per_s=bytes_per_s,
    )
    return ServerProtocol(RUN, "s", limits, Nobody())


def frame(header: bytes) -> bytes:
    return wire._PREFIX.pack(wire.MAGIC, wire.FORMAT_VERSION, len(header)) + header


def heavy_header(n: int = 32_000) -> bytes:
    """A registration whose class counts hold ``n`` integers: a 64 KiB header."""
    doc = {"fmt": 1, "type": "register", "run": RUN, "msg": "i-1", "sent": 1.0, "payload": 0, "arrays": []}
    doc |= {"client": 1, "incarnation": "i", "num_samples": 0, "tier": "AVL_TRAIN", "class_counts": [0] * n}
    return frame(json.dumps(doc, separators=(",", ":")).encode())


def state(seq: int, cid: int = 1) -> bytes:
    msg = wire.State(
        run=RUN, msg_id=f"i-{seq}", sent_at=1.0, client=cid, incarnation="i", tier=Tier.AVL_TRAIN
    )
    return wire.encode(msg)


def test_heavy_headers_are_refused_before_parsing_and_cost_about_a_normal_message() -> None:
    heavy = heavy_header()
    assert 60_000 < len(heavy) < wire.MAX_HEADER_BYTES
    p = protocol(cpu_share=None)
    got = p.receive(At.register(1), heavy, 1.0)
    assert isinstance(got, Refused) and got.kind is Refusal.BAD_HEADER
    assert f"exceeds {wire.header_limit(10)}" in got.detail
    nested = frame(b'{"x":' + b"[" * 3000 + b"]" * 3000 + b"}")
    got = p.receive(At.register(1), nested, 1.0)
    assert isinstance(got, Refused) and got.kind is Refusal.BAD_HEADER
    assert "opens 3001 lists or objects" in got.detail

    def cost(payloads: list[bytes]) -> float:
        start = time.perf_counter()
        for data in payloads:
            p.receive(At.state(1), data, 1.0)
        return (time.perf_counter() - start) / len(payloads)

    normal = cost([state(i) for i in range(2, 402)])
    refused = cost([heavy] * 400)
    assert refused < 5 * normal, (
        f"a heavy header costs {refused * 1e6:.0f} us, a normal message {normal * 1e6:.0f} us"
    )


def test_decode_time_is_charged_per_login_per_wall_second() -> None:
    """A login whose messages took 0.3 s of decoding (over its 0.25 s burst) is refused unread until
    its share (0.05 s per wall second) has paid that back, however much config time passes; another
    login is not affected."""
    p = protocol()
    assert isinstance(p.receive(At.state(1), state(2), 0.0, wall=100.0), Accepted)
    p.charge_decode(1, 0.3, 100.0)
    for now in (1.0, 1e6):  # config time is not what refills it
        got = p.receive(At.state(1), state(3), now, wall=100.5)
        assert isinstance(got, Refused) and got.kind is Refusal.COST_LIMIT
        assert got.reason == "transport: cost limit (decode time)"
    assert isinstance(p.receive(At.state(2), state(2, cid=2), 2e6, wall=100.5), Accepted)
    assert isinstance(p.receive(At.state(1), state(4), 3e6, wall=100.0 + 0.3 / 0.05 + 0.1), Accepted)
    assert p.stats.refused_by_kind == {"cost_limit": 2}


def test_payload_bytes_are_charged_per_login_per_wall_second() -> None:
    p = protocol(cpu_share=None, bytes_per_s=1 << 20)  # one largest message a second, burst one
    junk = b"FLXM" + bytes(1 << 19)
    kinds = [p.receive(At.result(1), junk, 0.0, wall=5.0) for _ in range(4)]
    # The first is read (and refused for what it is), the rest wait for the budget: refused unread.
    assert [k.kind for k in kinds if isinstance(k, Refused)] == [Refusal.UNKNOWN_VERSION] + [
        Refusal.COST_LIMIT
    ] * 3
    later = p.receive(At.result(1), junk, 0.0, wall=5.6)  # 0.6 s later: 0.6 MiB more
    assert isinstance(later, Refused) and later.kind is Refusal.UNKNOWN_VERSION
    assert p.stats.refused_by_kind["cost_limit"] == 3
