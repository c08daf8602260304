"""The deployment's server protocol alone (felix.deploy.protocol): bytes, a topic and a time in,
events or a typed refusal out; no broker, no thread, no clock."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest
from mqtt_support import At

from felix.core.commands import CancelTask, DispatchEval, DispatchTrain, UpdateRejected
from felix.core.events import ClientRegistered, TaskFailed, TaskFinished, TierChanged
from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.protocol import (
    Accepted,
    Duplicate,
    ProtocolLimits,
    Refused,
    ServerProtocol,
)
from felix.deploy.topics import Topics

RUN = "r1"

UPDATE_KEYS = ("num_samples", "stat_utility", "loss", "duration", "delta", "aux", "data_span")


N = 5  # model parameters


@dataclass
class FakeOrchestration:
    """What the protocol reads of an orchestrator, set by hand."""

    plans: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    registered: set[int] = field(default_factory=set)
    held: dict[int, int] = field(default_factory=dict)
    late: dict[int, int] = field(default_factory=dict)

    def is_registered(self, cid: int) -> bool:
        return cid in self.registered

    def held_task(self, cid: int) -> int | None:
        return self.held.get(cid)

    def late_task(self, cid: int) -> int | None:
        return self.late.get(cid)


def _protocol(rate: float | None = None, burst: float = 2.0) -> tuple[ServerProtocol, FakeOrchestration]:
    orch = FakeOrchestration()
    limits = ProtocolLimits(
        num_clients=4,
        num_classes=3,
        partition_sizes=[30, 30, 30, 30],
        max_bytes=1 << 16,
        aux_spec={},
        rate=rate,
        burst=burst,
    )
    return ServerProtocol(RUN, "sess", limits, orch), orch


def _register(cid: int = 1, msg_id: str = "inc-1", incarnation: str = "inc", **over: object) -> bytes:
    fields: dict[str, object] = {
        "run": RUN,
        "msg_id": msg_id,
        "sent_at": 1.0,
        "client": cid,
        "incarnation": incarnation,
        "num_samples": 30,
        "tier": Tier.AVL_TRAIN,
        "class_counts": (10, 10, 10),
    }
    fields.update(over)
    return wire.encode(wire.Register(**fields))  # type: ignore[arg-type]


def _result(cid: int = 1, task: int = 7, msg_id: str = "inc-2", version: int = 0, **over: object) -> bytes:
    fields: dict[str, object] = {
        "run": RUN,
        "msg_id": msg_id,
        "sent_at": 1.0,
        "client": cid,
        "incarnation": "inc",
        "task": task,
        "kind": TaskKind.TRAIN,
        "version": version,
        "num_samples": 30,
        "stat_utility": 1.0,
        "loss": 0.5,
        "duration": 3.0,
        "delta": np.full(N, 0.01, np.float32),
    }
    fields.update(over)
    update = {k: fields.pop(k) for k in UPDATE_KEYS if k in fields}
    return wire.encode(wire.Result(**fields, update=ClientUpdate(**update)))  # type: ignore[arg-type]


def _refusal(got: object) -> Refusal:
    assert isinstance(got, Refused), got
    return got.kind


def test_a_registration_becomes_the_orchestrators_event() -> None:
    p, _ = _protocol()
    got = p.receive(At.register(1), _register(), now=12.5)
    assert isinstance(got, Accepted) and got.wire_kind == "control"
    ((event, from_client),) = got.events
    assert isinstance(event, ClientRegistered) and from_client
    assert (event.time, event.client_id, event.num_samples, event.tier) == (12.5, 1, 30, Tier.AVL_TRAIN)
    assert p.incarnations == {1: "inc"} and p.stats.registrations == 1 and p.stats.rejected == 0


@pytest.mark.parametrize(
    ("source", "payload", "kind"),
    [
        (At.register(1), b"", Refusal.TRUNCATED),
        (At.register(1), b"JUNK" + b"\0" * 40, Refusal.BAD_MAGIC),
        (At.register(1), wire.MAGIC + b"\0" * (1 << 16), Refusal.OVERSIZED),
        (At.register(1), _register()[:-3], Refusal.TRUNCATED),
        (At.register(1), struct.pack("<4sHI", wire.MAGIC, 99, 2) + b"{}", Refusal.UNKNOWN_VERSION),
        (At.result(1), _register(), Refusal.TYPE_ON_TOPIC),
        (At.register(2), _register(cid=1), Refusal.SENDER_MISMATCH),
        (At.register(1), _register(run="other"), Refusal.OTHER_RUN),
        (At.register(1), _register(msg_id="no-sequence-x"), Refusal.MESSAGE_ID),
        (At.register(9), _register(cid=9), Refusal.OUTSIDE_POPULATION),
        (At.register(1), _register(class_counts=(10, 10)), Refusal.CLASS_COUNTS),
        (At.register(1), _register(class_counts=(10, 10, 11)), Refusal.CLASS_COUNTS),
        (At.register(1), _register(num_samples=31, class_counts=(11, 10, 10)), Refusal.TOO_MANY_SAMPLES),
        (At.result(1), _result(aux={"evil": np.zeros(3)}), Refusal.BAD_AUX),
    ],
)
def test_hostile_messages_get_a_typed_refusal(source: Address, payload: bytes, kind: Refusal) -> None:
    p, _ = _protocol()
    got = p.receive(source, payload, now=0.0)
    assert _refusal(got) is kind
    assert p.stats.refused_by_kind == {kind.value: 1} and p.stats.rejected == 1
    assert sum(p.stats.rejected_by_reason.values()) == 1  # and by its reason text, as before
    assert got.reason.startswith("transport: ")  # type: ignore[union-attr]
    assert not p.incarnations  # no refused registration is remembered


def test_decoded_refusals_count_their_bytes_and_undecoded_ones_as_control() -> None:
    p, _ = _protocol()
    assert p.receive(At.register(1), b"JUNK" + b"\0" * 40, 0.0).wire_kind == "control"
    assert p.unaddressed("transport: message on an unexpected topic").wire_kind is None
    assert p.receive(At.result(2), _result(cid=1), 0.0).wire_kind == "train"


def test_every_refusal_kind_is_a_stable_key() -> None:
    keys = [r.value for r in Refusal]
    assert len(keys) == len(set(keys)) and all(k.isidentifier() for k in keys)


def test_redeliveries_are_duplicates_and_replays_are_refused() -> None:
    p, orch = _protocol()
    assert isinstance(p.receive(At.register(1), _register(), 0.0), Accepted)
    orch.registered.add(1)
    again = p.receive(At.register(1), _register(), 1.0)
    assert isinstance(again, Duplicate) and p.stats.duplicates == 1
    res = _result()
    first = p.receive(At.result(1), res, 2.0)
    assert isinstance(first, Accepted) and isinstance(first.events[0][0], TaskFinished)
    # Until the orchestrator took it, a redelivery reaches it again (and it refuses or applies once).
    assert isinstance(p.receive(At.result(1), res, 2.5), Accepted)
    p.accepted(first)
    assert isinstance(p.receive(At.result(1), res, 3.0), Duplicate)
    replay = p.receive(At.result(1), _result(loss=9.0), 3.0)  # same id, other content
    assert _refusal(replay) is Refusal.REPLAY
    assert p.stats.duplicates == 2 and p.stats.refused_by_kind == {"replay": 1}


def test_a_restarted_client_loses_the_tasks_it_held_and_its_old_will_is_refused() -> None:
    p, orch = _protocol()
    p.receive(At.register(1), _register(incarnation="old", msg_id="old-1"), 0.0)
    orch.registered.add(1)
    orch.held[1], orch.late[1] = 11, 8
    got = p.receive(At.register(1), _register(incarnation="new", msg_id="new-1"), 5.0)
    assert isinstance(got, Accepted)
    kinds = [(type(e).__name__, getattr(e, "task_id", None), own) for e, own in got.events]
    assert kinds == [("TaskFailed", 11, False), ("TaskFailed", 8, False), ("TierChanged", None, True)]
    assert p.stats.client_restarts == 1 and p.stats.re_registrations == 1
    will = wire.State(run=RUN, msg_id="old-2", sent_at=1.0, client=1, incarnation="old", tier=Tier.UN_AVL)
    assert _refusal(p.receive(At.state(1), wire.encode(will), 6.0)) is Refusal.OLD_INCARNATION
    tier = wire.State(run=RUN, msg_id="new-2", sent_at=1.0, client=1, incarnation="new", tier=Tier.UN_AVL)
    ok = p.receive(At.state(1), wire.encode(tier), 7.0)
    assert isinstance(ok, Accepted) and isinstance(ok.events[0][0], TierChanged)


def test_a_data_plan_row_raises_the_registration_bound() -> None:
    p, orch = _protocol()
    big = _register(num_samples=34, class_counts=(12, 11, 11))
    assert _refusal(p.receive(At.register(1), big, 0.0)) is Refusal.TOO_MANY_SAMPLES
    orch.plans = {1: (2, 1, 1)}
    assert isinstance(
        p.receive(At.register(1), _register(num_samples=34, class_counts=(12, 11, 11), msg_id="inc-9"), 0.0),
        Accepted,
    )


def test_a_result_carries_its_kind_and_version_to_the_orchestrator() -> None:
    """The protocol keeps no record of dispatched tasks: a result's kind and version travel in
    its event, and the orchestrator's ledger checks them (test_orchestrator)."""
    p, _ = _protocol()
    out = p.send(DispatchTrain(7, 1, 3, np.zeros(N, np.float32)), sent_at=100.0)
    assert not isinstance(out, Refused) and out is not None
    assert (
        (out.channel, out.client) == (Channel.TASK, 1)
        and out.wire_kind == "train"
        and p.stats.messages_out == 1
    )
    sent = wire.decode(out.payload, 1 << 16)
    assert isinstance(sent, wire.TrainTask) and (sent.task, sent.version, sent.sent_at) == (7, 3, 100.0)
    got = p.receive(At.result(1), _result(version=2), 1.0)
    assert isinstance(got, Accepted)
    ev = got.events[0][0]
    assert isinstance(ev, TaskFinished) and (ev.task_id, ev.kind, ev.version) == (7, TaskKind.TRAIN, 2)
    evald = p.receive(At.result(1), _result(version=3, kind=TaskKind.EVAL, msg_id="inc-3", delta=None), 1.0)
    assert isinstance(evald, Accepted)
    assert (evald.events[0][0].kind, evald.wire_kind) == (TaskKind.EVAL, "eval")  # type: ignore[union-attr]
    ev8 = p.send(DispatchEval(8, 2, 3, np.zeros(N, np.float32)), 1.0)
    assert ev8 is not None and not isinstance(ev8, Refused) and ev8.wire_kind == "eval"
    cancel = p.send(CancelTask(8, 2, "straggler"), 1.0)
    assert cancel is not None and not isinstance(cancel, Refused) and cancel.wire_kind == "control"


def test_a_checkpoint_written_with_the_shadow_record_still_loads() -> None:
    """Checkpoints written before the ledger checked kind and version hold the protocol's own
    ``shadow`` copy of the dispatched tasks; they load, and the copy is not needed."""
    p, _ = _protocol()
    p.receive(At.register(1), _register(), 0.0)
    old = p.state_dict()
    old["shadow"] = {
        "task": np.array([7], np.int64),
        "client": np.array([1], np.int64),
        "train": np.array([1], np.int8),
        "version": np.array([0], np.int64),
    }
    q, _ = _protocol()
    q.load_state_dict(old)
    assert (q.seq_marks, q.incarnations) == (p.seq_marks, p.incarnations) != ({}, {})
    assert "shadow" not in q.state_dict()


def test_an_update_the_orchestrator_rejects_is_counted_by_kind_and_reason() -> None:
    p, _ = _protocol()
    got = p.send(
        UpdateRejected(0.0, 1, 7, "update norm 3.5 exceeds the bound 1.0", Refusal.INVALID_UPDATE), 0.0
    )
    assert _refusal(got) is Refusal.INVALID_UPDATE  # the orchestrator's kind, kept to the wire's count
    assert p.stats.rejected_by_reason == {"update norm N exceeds the bound N": 1}
    assert p.stats.refused_by_kind == {"invalid_update": 1}


def test_a_failure_report_closes_its_task_once() -> None:
    p, _ = _protocol()
    failed = wire.encode(
        wire.Failed(run=RUN, msg_id="inc-5", sent_at=1.0, client=1, incarnation="inc", task=4, reason="oom")
    )
    got = p.receive(At.result(1), failed, 2.0)
    assert isinstance(got, Accepted) and isinstance(got.events[0][0], TaskFailed)
    p.accepted(got)
    assert isinstance(p.receive(At.result(1), failed, 3.0), Duplicate)


def test_the_message_budget_is_spent_before_decoding() -> None:
    p, _ = _protocol(rate=1.0, burst=2.0)
    junk = b"JUNK" + b"\0" * 40
    kinds = [p.receive(At.state(1), junk, 0.0) for _ in range(4)]
    assert [_refusal(k) for k in kinds] == [Refusal.BAD_MAGIC] * 2 + [Refusal.RATE_LIMIT] * 2
    assert _refusal(p.receive(At.state(1), junk, 1.0)) is Refusal.BAD_MAGIC  # one token back a second later
    # Ids outside the population share one budget: made-up ids cannot each bring their own.
    made_up = [p.receive(At.state(100 + i), junk, 1.0) for i in range(3)]
    assert [_refusal(k) for k in made_up] == [Refusal.BAD_MAGIC] * 2 + [Refusal.RATE_LIMIT]


def test_the_protocol_state_round_trips_through_a_checkpoint() -> None:
    p, orch = _protocol()
    p.receive(At.register(1), _register(), 0.0)
    orch.registered.add(1)
    p.send(DispatchTrain(7, 1, 0, np.zeros(N, np.float32)), 0.0)
    first = p.receive(At.result(1), _result(), 1.0)
    assert isinstance(first, Accepted)
    p.accepted(first)
    q, _ = _protocol()
    q.load_state_dict(p.state_dict())
    assert (q.seq_marks, q.result_digests, q.incarnations) == (
        p.seq_marks,
        p.result_digests,
        p.incarnations,
    )
    assert isinstance(q.receive(At.result(1), _result(), 2.0), Duplicate)


@pytest.mark.parametrize(
    "topic", ["felix/r1/elsewhere/1", "felix/r1/server/register/x", "felix/r2/server/state/1"]
)
def test_a_topic_of_no_channel_is_refused_unread(topic: str) -> None:
    """The MQTT shell maps a topic to its channel and client; one that maps to none is a TOPIC
    refusal, counted like any other."""
    assert Topics(RUN).parse_inbound_to_server(topic) is None
    p, _ = _protocol()
    got = p.unaddressed(f"transport: message on an unexpected topic {topic!r}")
    assert _refusal(got) is Refusal.TOPIC and p.stats.messages_in == 1
    assert p.stats.refused_by_kind == {"topic": 1} and p.stats.rejected == 1
