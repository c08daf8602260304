"""Hostile input over a real broker: a raw paho client, logged in as client 0, sends malformed,
forged, replayed, oversized and non-finite messages. Each is rejected with its reason (or, for a
verbatim redelivery, counted as a duplicate), nothing bad is applied, and the run goes on."""

from __future__ import annotations

import json
import queue
import struct
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_clients,
    start_server,
    users,
    wait_until,
    write_config,
)

from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.topics import Topics
from felix.deploy.transport import Ack

pytestmark = needs_mosquitto
T = Topics("t")

UPDATE_KEYS = ("num_samples", "stat_utility", "loss", "duration", "delta", "aux", "data_span")


class RawClient:
    """A bare paho client: what an attacker holding client 0's password can do."""

    def __init__(
        self, port: int, user: str, password: str, subscribe: list[str], client_id: str | None = None
    ) -> None:
        self.inbox: queue.Queue[wire.Message] = queue.Queue()
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"raw-{user}", protocol=mqtt.MQTTv5
        )
        self.c.username_pw_set(user, password)
        self.c.on_message = lambda c, u, m: self.inbox.put(wire.decode(m.payload))
        self.c.on_connect = lambda c, u, f, rc, p: (
            c.subscribe([(t, 1) for t in subscribe]) if subscribe else None
        )
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def send(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def next(self, kind: type, timeout: float = 15.0) -> wire.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {timeout} s")

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _reframe(data: bytes, **header: object) -> bytes:
    """Rewrite header fields of an encoded message, keeping the frame consistent."""
    _, version, hlen = struct.unpack_from("<4sHI", data)
    doc = json.loads(data[10 : 10 + hlen])
    doc.update(header)
    h = json.dumps(doc).encode()
    return struct.pack("<4sHI", wire.MAGIC, version, len(h)) + h + data[10 + hlen :]


def _result(of: wire.TrainTask, msg_id: str, delta: np.ndarray, **over: object) -> wire.Result:
    fields: dict[str, object] = {
        "run": "t",
        "msg_id": msg_id,
        "sent_at": time.time(),
        "client": 0,
        "incarnation": "raw",
        "task": of.task,
        "kind": TaskKind.TRAIN,
        "version": of.version,
        "num_samples": 30,
        "stat_utility": 2.0,
        "loss": 0.5,
        "duration": 3.0,
        "delta": delta,
    }
    fields.update(over)
    update = {k: fields.pop(k) for k in UPDATE_KEYS if k in fields}
    return wire.Result(**fields, update=ClientUpdate(**update))  # type: ignore[arg-type]


def test_hostile_messages_are_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 1},
            "run": {"max_aggregations": 2, "target_accuracy": 1.0},
        },
    )
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        server, thread = start_server(cfg, broker, tmp_path / "out", 1.0)
        raw = RawClient(broker.port, "client-0", u["client-0"], [T.task(0), T.status])
        try:
            raw.next(wire.Status)
            reg = wire.Register(
                run="t",
                msg_id="raw-1",
                sent_at=time.time(),
                client=0,
                incarnation="raw",
                num_samples=30,
                tier=Tier.AVL_TRAIN,
                class_counts=(3,) * 10,
            )
            bad_counts = wire.Register(
                run="t",
                msg_id="raw-0",
                sent_at=time.time(),
                client=0,
                incarnation="raw",
                num_samples=30,
                tier=Tier.AVL_TRAIN,
                class_counts=(30,),
            )
            raw.send(T.register(0), wire.encode(bad_counts))  # counts that do not fit the dataset: refused
            raw.send(T.register(0), wire.encode(reg))
            task = raw.next(wire.TrainTask)
            assert isinstance(task, wire.TrainTask)
            n = task.weights.size
            good = _result(task, "raw-2", np.full(n, 1e-3, np.float32))
            good_bytes = wire.encode(good)
            bad_version = bytearray(good_bytes)
            struct.pack_into("<H", bad_version, 4, 99)
            res = T.result(0)
            sent = [
                (res, b"\x80\x04\x95pickle-ish garbage"),  # bad magic
                (res, good_bytes[:-5]),  # truncated
                (res, bytes(bad_version)),  # unknown format version
                (res, _reframe(good_bytes, type="exec")),  # unknown type
                (res, _reframe(good_bytes, task=str(task.task))),  # bad field type
                (res, b"FLXM" + b"\0" * (server.max_bytes + 10)),  # oversized
                (res, wire.encode(_result(task, "raw-3", good.update.delta, client=1))),  # forged sender
                (
                    T.result(1),
                    wire.encode(_result(task, "raw-4", good.update.delta, client=1)),
                ),  # other's topic: ACL drops it
                (res, wire.encode(_result(task, "raw-5", good.update.delta, run="other"))),  # another run
                (
                    res,
                    wire.encode(
                        wire.Cancel(run="t", msg_id="raw-6", sent_at=1.0, client=0, task=1, reason="x")
                    ),
                ),
                (
                    res,
                    wire.encode(_result(task, "raw-7", np.full(n, np.nan, np.float32))),
                ),  # non-finite update
                (
                    res,
                    wire.encode(_result(task, "raw-8", good.update.delta, loss=float("inf"))),
                ),  # out of range: decode
                (res, wire.encode(_result(task, "raw-9", np.zeros(n + 1, np.float32)))),  # wrong shape
                (
                    res,
                    wire.encode(_result(task, "raw-10", good.update.delta, task=task.task + 1000)),
                ),  # never assigned
                (
                    res,
                    wire.encode(_result(task, "raw-11", good.update.delta, version=task.version + 5)),
                ),  # wrong version
                (res, good_bytes),  # the valid update: applied -> version 1
                (res, good_bytes),  # verbatim redelivery: a duplicate, not an error
                (
                    res,
                    wire.encode(_result(task, "raw-2", good.update.delta, loss=0.9)),
                ),  # same id, other content
                (
                    res,
                    wire.encode(_result(task, "raw-12", good.update.delta)),
                ),  # a second result for an applied task
            ]
            for topic, payload in sent:
                raw.send(topic, payload)
            wait_until(lambda: server.orch.version >= 1, 15, "the valid update to be applied")
            task2 = raw.next(wire.TrainTask)
            assert isinstance(task2, wire.TrainTask) and task2.version == 1
            raw.send(res, wire.encode(_result(task2, "raw-13", np.zeros(n, np.float32))))
            summ = thread.result(30)
        finally:
            server.stop_requested.set()
            raw.close()
    assert summ["stop_reason"] == "max_aggregations" and summ["aggregations"] == 2
    assert summ["updates_applied"] == 2 and summ["transport"]["duplicates"] == 1
    reasons = summ["rejected_by_reason"]
    expected = {
        "transport: registration's class counts do not match the classes or the samples": 1,
        "transport: bad_magic": 1,
        "transport: truncated": 1,
        "transport: unknown_version": 1,
        "transport: unknown_type": 1,
        "transport: bad_field": 2,  # a field of the wrong type, and a loss outside its declared range
        "transport: oversized": 1,
        "transport: sender mismatch: header says client N, topic belongs to client N": 1,
        "transport: message for run 'other'": 1,
        "transport: cancel message on a result topic": 1,
        "model update holds non-finite values": 1,
        "model update of shape (N,)/float32, expected (N,)/float32": 1,
        "result for a task the server never assigned": 1,
        "result computed on version N, task was dispatched with version N": 1,
        "transport: replayed message id with different content": 1,
        "replayed result: task already applied": 1,
    }
    assert reasons == expected, reasons
    assert summ["transport"]["rejected"] == sum(expected.values())  # all rejections, shell and orchestrator
    assert (
        summ["diagnostics"]["rejected"] == 5
    )  # those the orchestrator made itself (its ledger: the version)
    # The message on client 1's topic never reached the server: the broker's ACL dropped it.
    assert summ["transport"]["messages_in"] == 2 + len(sent) - 1 + 1


def _register(raw: RawClient, cid: int) -> wire.TrainTask:
    reg = wire.Register(
        run="t",
        msg_id=f"raw{cid}-0",
        sent_at=time.time(),
        client=cid,
        incarnation="raw",
        num_samples=30,
        tier=Tier.AVL_TRAIN,
        class_counts=(3,) * 10,
    )
    raw.next(wire.Status)
    raw.send(T.register(cid), wire.encode(reg))
    task = raw.next(wire.TrainTask)
    assert isinstance(task, wire.TrainTask)
    return task


def test_poison_and_aux_injection_are_rejected_at_the_server(tmp_path: Path) -> None:
    """Issue 11, findings 1 and 2, over the broker. Before: the poisoned update (values near 3e38,
    num_samples 2^40) was applied and the model never recovered; two aux entries of one new key
    and different shapes made aggregation raise and the server exit; a large aux entry was shipped
    with every later task."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 2},
            "run": {"max_aggregations": 2, "target_accuracy": 1.0},
        },
    )
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        server, thread = start_server(cfg, broker, tmp_path / "out", 1.0)
        raw0 = RawClient(broker.port, "client-0", u["client-0"], [T.task(0), T.status])
        raw1 = RawClient(broker.port, "client-1", u["client-1"], [T.task(1), T.status])
        try:
            inflated = wire.Register(
                run="t",
                msg_id="raw0-1",
                sent_at=time.time(),
                client=0,
                incarnation="raw",
                num_samples=2**40,
                tier=Tier.AVL_TRAIN,
                class_counts=(2**40 - 9,) + (1,) * 9,
            )
            t0, t1 = _register(raw0, 0), _register(raw1, 1)
            raw0.send(T.register(0), wire.encode(inflated))  # would lift its sample bound: refused
            n = t0.weights.size
            ok = np.full(n, 1e-3, np.float32)
            huge = np.full(n, 3e38, np.float32)
            for raw, topic, res in [
                (raw0, T.result(0), _result(t0, "p-1", huge, num_samples=2**40)),  # the poison
                (raw0, T.result(0), _result(t0, "p-2", huge)),  # huge, with a plausible sample count
                (raw0, T.result(0), _result(t0, "p-3", ok, aux={"evil": np.zeros(3)})),
                (raw1, T.result(1), _result(t1, "p-4", ok, client=1, aux={"evil": np.zeros(5)})),
                (raw0, T.result(0), _result(t0, "p-5", ok, aux={"big": np.ones(200_000, np.float32)})),
                (raw0, T.result(0), _result(t0, "p-6", ok)),  # honest: version 1
            ]:
                raw.send(topic, wire.encode(res))
            nxt = raw0.next(wire.TrainTask)
            assert isinstance(nxt, wire.TrainTask) and nxt.version == 1 and nxt.aux == {}  # nothing planted
            raw1.send(T.result(1), wire.encode(_result(t1, "p-7", ok, client=1)))
            summ = thread.result(30)
        finally:
            server.stop_requested.set()
            raw0.close()
            raw1.close()
    assert summ["stop_reason"] == "max_aggregations" and summ["updates_applied"] == 2
    assert np.abs(server.orch.weights).max() < 10.0  # finite and not blown up
    assert summ["rejected_by_reason"] == {
        "num_samples N exceeds the N the client registered (+N planned)": 1,
        "update norm N exceeds the bound N (N x the model's norm, until N clients have sent updates)": 1,
        "transport: bad_aux": 3,
        "transport: registration claims more samples than the client's partition holds": 1,
    }, summ["rejected_by_reason"]


def test_a_message_whose_handling_raises_is_rejected_and_acknowledged(tmp_path: Path) -> None:
    """Issue 11, finding 2: the server must never exit because of a client's message, and must
    acknowledge it (before, the unacknowledged message was redelivered to every --resume)."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 1},
            "run": {"max_aggregations": 1, "target_accuracy": 1.0},
        },
    )
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        server, thread = start_server(
            cfg, broker, tmp_path / "out", 1.0, checkpoint=tmp_path / "ck.safetensors"
        )
        inbound: list[tuple[int, int]] = []
        acked: list[tuple[int, int]] = []
        on_inbound, ack, deliver = server._on_inbound, server.link.ack, server._deliver
        raised: list[bool] = []

        def record_inbound(m, *verdict):  # type: ignore[no-untyped-def]
            inbound.append((m.ack.token, m.ack.epoch))
            on_inbound(m, *verdict)

        def record_acks(items: list[Ack]) -> None:
            acked.extend((a.token, a.epoch) for a in items)
            ack(items)

        def fragile(event):  # type: ignore[no-untyped-def]
            if type(event).__name__ == "TaskFinished" and not raised:
                raised.append(True)
                raise RuntimeError("boom")
            deliver(event)

        server._on_inbound, server.link.ack, server._deliver = record_inbound, record_acks, fragile  # type: ignore
        raw = RawClient(broker.port, "client-0", u["client-0"], [T.task(0), T.status])
        try:
            task = _register(raw, 0)
            ok = np.full(task.weights.size, 1e-3, np.float32)
            raw.send(T.result(0), wire.encode(_result(task, "h-1", ok)))  # handling raises
            raw.send(T.result(0), wire.encode(_result(task, "h-2", ok)))  # handled: version 1, the run ends
            summ = thread.result(30)
        finally:
            server.stop_requested.set()
            raw.close()
    assert summ["rejected_by_reason"] == {"internal error: RuntimeError": 1}
    assert summ["updates_applied"] == 1 and len(inbound) == 3
    assert set(inbound) <= set(acked), (inbound, acked)


def test_no_client_can_take_over_the_server_or_another_clients_id(tmp_path: Path) -> None:
    """Issue 11, finding 3. Before: client ids were predictable (felix-<run>-server,
    felix-<run>-c<id>) and not bound to the login, so a client connecting with the server's id
    kicked the server off and wiped its session. Now the broker makes the login the client id."""
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}),
        {
            "strategy": "fedbuff",
            "orchestrator": {"agg_goal": 1, "concurrency": 2},
            "run": {"max_aggregations": 6, "target_accuracy": 1.0},
        },
    )
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        server, thread = start_server(cfg, broker, tmp_path / "out", 0.01)
        host, clients = start_clients(cfg, broker, [1, 2, 3], 0.01)
        attackers = []
        try:
            wait_until(lambda: len(server.orch.clients) == 3, 30, "three clients to register")
            for victim in ("felix-t-server", "felix-server", "felix-t-c1", "client-1"):
                attackers.append(RawClient(broker.port, "client-0", u["client-0"], [], client_id=victim))
            time.sleep(1.0)
            summ = thread.result(60)
            clients.result(30)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()
            for a in attackers:
                a.close()
    assert summ["stop_reason"] == "max_aggregations"
    assert summ["transport"]["reconnects"] == 0  # the server was never kicked off
    assert all(dev.link is not None and dev.link.mqtt.epoch == 1 for dev in host.devices.values())


def test_tls_name_mismatch_says_so(tmp_path: Path) -> None:
    """docs item of issue 11: a certificate that does not name the --broker host failed with only
    "no answer from the broker"; the error now says what is wrong and what to do."""
    from felix.deploy.link import BrokerOptions, LinkError, MqttLink

    with MosquittoBroker(1, workdir=tmp_path / "broker", tls=True) as broker:
        u = users(broker)
        # The test certificate names 127.0.0.1; "localhost" reaches the same broker but not the name.
        opts = BrokerOptions(
            "localhost",
            broker.port,
            "felix-server",
            u["felix-server"],
            tls_ca=str(broker.ca_file),
            connect_timeout_s=1.5,
        )
        for fresh in (True, False):
            link = MqttLink("x", opts, [], lambda item: None)
            with pytest.raises(
                LinkError, match=r"certificate that does not verify.*--broker \('localhost'\)"
            ):
                link.start(fresh=fresh)
        good = MqttLink(
            "x",
            BrokerOptions(**{**opts.__dict__, "host": "127.0.0.1", "connect_timeout_s": 20.0}),
            [],
            lambda item: None,
        )
        good.start(fresh=True)
        good.close()
