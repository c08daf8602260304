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
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    start_server,
    users,
    wait_until,
    write_config,
)

from felix.core.types import TaskKind, Tier
from felix.runtime import wire
from felix.runtime.broker import MosquittoBroker
from felix.runtime.topics import Topics

pytestmark = needs_mosquitto
T = Topics("t")


class RawClient:
    """A bare paho client: what an attacker holding client 0's password can do."""

    def __init__(self, port: int, user: str, password: str, subscribe: list[str]) -> None:
        self.inbox: queue.Queue[wire.Message] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"raw-{user}", protocol=mqtt.MQTTv5)
        self.c.username_pw_set(user, password)
        self.c.on_message = lambda c, u, m: self.inbox.put(wire.decode(m.payload))
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe([(t, 1) for t in subscribe])
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
    doc = json.loads(data[10:10 + hlen])
    doc.update(header)
    h = json.dumps(doc).encode()
    return struct.pack("<4sHI", wire.MAGIC, version, len(h)) + h + data[10 + hlen:]


def _result(of: wire.TrainTask, msg_id: str, delta: np.ndarray, **over: object) -> wire.Result:
    fields: dict[str, object] = {
        "run": "t", "msg_id": msg_id, "sent_at": time.time(), "client": 0, "incarnation": "raw", "task": of.task,
        "kind": TaskKind.TRAIN, "version": of.version, "num_samples": 30, "stat_utility": 2.0, "loss": 0.5,
        "duration": 3.0, "delta": delta}
    fields.update(over)
    return wire.Result(**fields)  # type: ignore[arg-type]


def test_hostile_messages_are_rejected_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}), {
        "strategy": "fedbuff", "orchestrator": {"agg_goal": 1, "concurrency": 1},
        "run": {"max_aggregations": 2, "target_accuracy": 1.0}})
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        u = users(broker)
        server, thread = start_server(cfg, broker, tmp_path / "out", 1.0)
        raw = RawClient(broker.port, "client-0", u["client-0"], [T.task(0), T.status])
        try:
            raw.next(wire.Status)
            reg = wire.Register(run="t", msg_id="raw-1", sent_at=time.time(), client=0, incarnation="raw",
                                num_samples=30, tier=Tier.AVL_TRAIN, class_counts=(3,) * 10)
            bad_counts = wire.Register(run="t", msg_id="raw-0", sent_at=time.time(), client=0, incarnation="raw",
                                       num_samples=30, tier=Tier.AVL_TRAIN, class_counts=(30,))
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
                (res, wire.encode(_result(task, "raw-3", good.delta, client=1))),  # forged sender
                (T.result(1), wire.encode(_result(task, "raw-4", good.delta, client=1))),  # other's topic: ACL drops it
                (res, wire.encode(_result(task, "raw-5", good.delta, run="other"))),  # another run
                (res, wire.encode(wire.Cancel(run="t", msg_id="raw-6", sent_at=1.0, client=0, task=1, reason="x"))),
                (res, wire.encode(_result(task, "raw-7", np.full(n, np.nan, np.float32)))),  # non-finite update
                (res, wire.encode(_result(task, "raw-8", good.delta, loss=float("inf")))),  # non-finite loss
                (res, wire.encode(_result(task, "raw-9", np.zeros(n + 1, np.float32)))),  # wrong shape
                (res, wire.encode(_result(task, "raw-10", good.delta, task=task.task + 1000))),  # never assigned
                (res, wire.encode(_result(task, "raw-11", good.delta, version=task.version + 5))),  # wrong version
                (res, good_bytes),  # the valid update: applied -> version 1
                (res, good_bytes),  # verbatim redelivery: a duplicate, not an error
                (res, wire.encode(_result(task, "raw-2", good.delta, loss=0.9))),  # same id, other content
                (res, wire.encode(_result(task, "raw-12", good.delta))),  # a second result for an applied task
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
        "transport: bad_field": 1,
        "transport: oversized": 1,
        "transport: sender mismatch: header says client N, topic belongs to client N": 1,
        "transport: message for run 'other'": 1,
        "transport: cancel message on a result topic": 1,
        "model update holds non-finite values": 1,
        "non-finite loss, utility or duration": 1,
        "model update of shape (N,)/float32, expected (N,)/float32": 1,
        "result for a task the server never assigned": 1,
        "result computed on version N, task was dispatched with version N": 1,
        "transport: replayed message id with different content": 1,
        "replayed result: task already applied": 1,
    }
    assert reasons == expected, reasons
    assert summ["transport"]["rejected"] == sum(expected.values())  # all rejections, shell and orchestrator
    assert summ["diagnostics"]["rejected"] == 5  # those the orchestrator made itself
    # The message on client 1's topic never reached the server: the broker's ACL dropped it.
    assert summ["transport"]["messages_in"] == 2 + len(sent) - 1 + 1
