"""The decode worker (``ServeOptions.decode_worker``): inbound messages parsed in a second process
get the same verdicts as parsed in the loop, in the same order, and a deployment through it
applies each update once."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from mqtt_support import Background, load_config, one_torch_thread, run_in_memory, write_config  # noqa: F401

from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import server as server_module
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.decode_worker import DecodeWorker
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import WORKER_MIN_BATCH, ServeOptions, Server
from felix.deploy.transport import Ack, Delivery

CLIENTS = 4


def _server(tmp_path: Path, worker: bool) -> Server:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": CLIENTS}, trace={"kind": "always"}),
        {"strategy": "fedbuff", "orchestrator": {"agg_goal": 2, "concurrency": 2}},
    )
    opts = ServeOptions(
        MemoryOptions(),
        run_id="r",
        time_scale=1.0,
        status_every_s=1e9,
        transport="memory",
        decode_worker=worker,
    )
    return Server(cfg, opts)


def _hostile_and_honest(srv: Server) -> list[Delivery]:
    """Registrations, tier reports, a result, and malformed messages of several decoding kinds."""
    env = lambda i: {"run": "r", "msg_id": f"i-{i}", "sent_at": time.time()}
    out: list[tuple[Address, bytes]] = []
    for c in range(CLIENTS):
        counts = [0] * srv.num_classes
        counts[0] = srv.partition_sizes[c]
        reg = wire.Register(
            **env(1),
            client=c,
            incarnation="i",
            num_samples=counts[0],
            tier=Tier.AVL_TRAIN,
            class_counts=tuple(counts),
        )
        out.append((Address(Channel.REGISTER, c), wire.encode(reg)))
    state = wire.encode(wire.State(**env(2), client=1, incarnation="i", tier=Tier.UN_AVL))
    out.append((Address(Channel.STATE, 1), state))
    out.append((Address(Channel.STATE, 1), state))  # a redelivery: a duplicate
    hdr = {"fmt": 1, "type": "state", "run": "r", "msg": "i-9", "sent": 1.0, "payload": 0, "arrays": []}
    heavy = json.dumps(
        {**hdr, "client": 2, "incarnation": "i", "tier": "AVL_TRAIN", "x": [0] * 9000}
    ).encode()
    surrogate = json.dumps({**hdr, "client": 2, "incarnation": "i\\ud800", "tier": "AVL_TRAIN"})
    surrogate_b = surrogate.replace("\\\\ud800", "\\ud800").encode()
    upd = ClientUpdate(num_samples=5, stat_utility=1.0, loss=0.5, duration=1.0, delta=np.zeros(3, np.float32))
    wrong = wire.encode(
        wire.Result(**env(3), client=2, incarnation="i", task=1, kind=TaskKind.TRAIN, version=0, update=upd)
    )
    for payload in (
        b"FLXM",  # truncated
        b"XXXX" + bytes(20),  # bad magic
        struct.pack("<4sHI", wire.MAGIC, 1, len(heavy)) + heavy,  # a header over the limit
        struct.pack("<4sHI", wire.MAGIC, 1, len(surrogate_b)) + surrogate_b,  # a lone surrogate
        state.replace(b'"run":"r"', b'"run":"q"'),  # another run
        wrong,  # a result for a task never assigned (the orchestrator's refusal)
    ):
        out.append((Address(Channel.STATE if b'"state"' in payload else Channel.RESULT, 2), payload))
    out.append(
        (
            Address(Channel.STATE, 0),
            wire.encode(wire.State(**env(4), client=0, incarnation="i", tier=Tier.UN_AVL)),
        )
    )
    return [Delivery(a, p, Ack(0, 0, 1), "t") for a, p in out]


def test_the_worker_gives_the_loops_verdicts_in_order(tmp_path: Path) -> None:
    plain, piped = _server(tmp_path / "a", False), _server(tmp_path / "b", True)
    for m in _hostile_and_honest(plain):
        plain.handle_inbound(m)
    decoder = DecodeWorker(piped.max_bytes, piped.protocol.header_bytes)
    try:
        items = _hostile_and_honest(piped)
        piped._pipeline(decoder, items[:5])  # two batches: the first is applied with the second
        piped._pipeline(decoder, items[5:])
        # The first batch is applied, the second is still being parsed.
        assert len(piped.orch.clients) == CLIENTS and piped.stats.rejected == 0
        piped._pipeline(decoder, [])
    finally:
        decoder.close()
    for s in (plain.stats, piped.stats):
        assert s.refused_by_kind == {
            Refusal.TRUNCATED.value: 1,
            Refusal.BAD_MAGIC.value: 1,
            Refusal.BAD_HEADER.value: 2,
            Refusal.OTHER_RUN.value: 1,
            Refusal.NOT_HOLDER.value: 1,
        }
        assert s.duplicates == 1 and s.messages_in == 13 and s.registrations == CLIENTS
    tiers = [[srv.orch.clients[c].tier for c in range(CLIENTS)] for srv in (plain, piped)]
    assert tiers[0] == tiers[1]


def test_a_small_batch_is_parsed_in_the_loop_and_a_large_one_by_the_worker(tmp_path: Path) -> None:
    """A round trip to the worker costs the loop more than parsing a few messages: a batch under
    ``WORKER_MIN_BATCH`` is left to the loop, after what is in flight, and the verdicts are the
    loop's, in order."""
    plain, piped = _server(tmp_path / "a", False), _server(tmp_path / "b", True)
    for m in _hostile_and_honest(plain):
        plain.handle_inbound(m)
    decoder = piped.decoder = DecodeWorker(piped.max_bytes, piped.protocol.header_bytes)
    sent: list[int] = []
    submit = decoder.submit

    def counted(payloads: list[bytes]) -> None:
        sent.append(len(payloads))
        submit(payloads)

    decoder.submit = counted  # type: ignore[method-assign]
    try:
        items = _hostile_and_honest(piped)
        first, rest = items[:WORKER_MIN_BATCH], items[WORKER_MIN_BATCH:]
        assert 0 < len(rest) < WORKER_MIN_BATCH
        assert piped._intake(first) == [] and sent == [WORKER_MIN_BATCH]  # in flight
        assert piped._intake(rest) == rest and sent == [WORKER_MIN_BATCH]  # the loop's to parse
        assert piped.stats.messages_in == WORKER_MIN_BATCH and not piped._parsing  # the first applied
        for m in rest:
            piped.handle_inbound(m)
        assert piped._intake(rest[:1]) == rest[:1] and sent == [WORKER_MIN_BATCH]
    finally:
        decoder.close()
    for s in (plain.stats, piped.stats):
        assert s.duplicates == 1 and s.messages_in == 13 and s.registrations == CLIENTS
    assert plain.stats.refused_by_kind == piped.stats.refused_by_kind
    tiers = [[srv.orch.clients[c].tier for c in range(CLIENTS)] for srv in (plain, piped)]
    assert tiers[0] == tiers[1]


def test_the_worker_builds_messages_without_arrays_and_each_sender_is_charged_its_time(
    tmp_path: Path,
) -> None:
    """A registration or tier report comes back built (the message the loop would build), a
    result as its checked header (its aux entries are the loop's to check); each message's
    sender is charged at least the worker's time for it."""
    srv = _server(tmp_path, True)
    items = _hostile_and_honest(srv)
    decoder = DecodeWorker(srv.max_bytes, srv.protocol.header_bytes)
    try:
        decoder.submit([m.payload for m in items])
        results = decoder.collect()
    finally:
        decoder.close()
    kinds = [type(r).__name__ for r, _ in results]
    assert kinds[: CLIENTS + 2] == ["Register"] * CLIENTS + ["State", "State"]
    assert results[CLIENTS][0] == wire.decode(items[CLIENTS].payload)
    assert kinds.count("Parsed") == 1  # the result for a task never assigned
    assert kinds[-1] == "State" and all(s > 0.0 for _, s in results)

    srv = _server(tmp_path / "charged", True)
    charged: list[tuple[int, float]] = []
    srv.protocol.charge_decode = lambda cid, s, wall: charged.append((cid, s))  # type: ignore[method-assign]
    decoder = DecodeWorker(srv.max_bytes, srv.protocol.header_bytes)
    parse_s: list[float] = []
    collect = decoder.collect

    def timed() -> list[tuple[object, float]]:
        out = collect()
        parse_s.extend(s for _, s in out)
        return out  # type: ignore[return-value]

    decoder.collect = timed  # type: ignore[method-assign]
    try:
        items = _hostile_and_honest(srv)
        srv._pipeline(decoder, items)
        srv._pipeline(decoder, [])
    finally:
        decoder.close()
    assert [c for c, _ in charged] == [m.address.client for m in items if m.address is not None]
    assert all(s >= p > 0.0 for (_, s), p in zip(charged, parse_s, strict=True))


def test_a_result_whose_building_raises_is_refused_alone(tmp_path: Path) -> None:
    """The loop builds a batch's results in one pass: an unexpected exception building one is
    that message's internal error, and the rest of the batch is handled as usual."""
    srv = _server(tmp_path, True)
    build = srv.protocol.build

    def broken(parsed: object, payload: bytes) -> object:
        if isinstance(parsed, wire.Parsed):
            raise TypeError("boom")
        return build(parsed, payload)  # type: ignore[arg-type]

    srv.protocol.build = broken  # type: ignore[method-assign,assignment]
    decoder = DecodeWorker(srv.max_bytes, srv.protocol.header_bytes)
    try:
        srv._pipeline(decoder, _hostile_and_honest(srv))
        srv._pipeline(decoder, [])
    finally:
        decoder.close()
    assert srv.stats.refused_by_kind[Refusal.INTERNAL.value] == 1  # the result, in place of not_holder
    assert Refusal.NOT_HOLDER.value not in srv.stats.refused_by_kind
    assert srv.stats.registrations == CLIENTS and srv.stats.duplicates == 1
    assert srv.orch.clients[0].reported_tier is Tier.UN_AVL  # the batch's last message was applied


def test_a_worker_that_dies_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    from felix.deploy.decode_worker import DecodeWorkerError

    srv = _server(tmp_path, True)
    decoder = DecodeWorker(srv.max_bytes, srv.protocol.header_bytes, timeout_s=5.0)
    decoder._proc.kill()
    decoder._proc.wait(5)
    with pytest.raises(DecodeWorkerError, match="decode worker"):
        decoder.submit([b"x"] * 1000)
        decoder.collect()
    decoder.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_deployment_through_the_decode_worker_applies_each_update_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four clients send a few messages per loop turn: every batch goes to the worker here.
    monkeypatch.setattr(server_module, "WORKER_MIN_BATCH", 1)
    submitted: list[int] = []
    submit = DecodeWorker.submit

    def counted(self: DecodeWorker, payloads: list[bytes]) -> None:
        submitted.append(len(payloads))
        submit(self, payloads)

    monkeypatch.setattr(DecodeWorker, "submit", counted)
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": CLIENTS}, trace={"kind": "always"}),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 2, "concurrency": 3},
            "run": {"max_aggregations": 5, "target_accuracy": 1.0},
        },
    )
    server, _, summ = run_in_memory(cfg, tmp_path / "out", "dw", decode_worker=True)
    assert summ["stop_reason"] == "max_aggregations"
    assert summ["deployment"]["applied_task_ids_unique"] and summ["updates_applied"] == 10
    assert summ["transport"]["rejected"] == 0 and server.decoder is not None
    assert sum(submitted) >= summ["transport"]["messages_in"] - CLIENTS  # all but a few went through it
