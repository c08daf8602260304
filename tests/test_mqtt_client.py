"""The deployment client's task handling, on its loop with a fake link (no broker needed):
an interrupted task pauses and resumes, tier changes are reported, cancels and redeliveries."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from mqtt_support import one_torch_thread  # noqa: F401  (a fixture)

from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.client import ClientHost, ClientOptions, Device
from felix.deploy.link import BrokerOptions
from felix.deploy.transport import Ack, Delivery
from felix.engine.device import DeviceTask
from felix.engine.setup import resolve_config
from felix.scenario.traces import DeviceTrace

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SCALE = 0.2  # 1 config second = 200 ms: wide enough for a loaded machine's timer delays


class FakeLink:
    """Records what the client publishes; stops the loop after ``results`` results (tests never
    wait on a fixed sleep, so a loaded machine only makes them slower)."""

    def __init__(self, host: ClientHost, results: int) -> None:
        self.host = host
        self.results = results
        self.sent: list[tuple[float, wire.Message]] = []  # (trace time, message)

    def send(self, channel: Channel, payload: bytes) -> None:
        msg = wire.decode(payload)
        self.sent.append((self.host.trace_time(), msg))
        if sum(isinstance(m, wire.Result) for _, m in self.sent) >= self.results:
            self.host.stop_requested.set()


def _host(results: int) -> tuple[ClientHost, Device, FakeLink]:
    cfg = resolve_config(
        None,
        "fedbuff",
        {"model": "mlp", "partition": {"num_clients": 2}, "runtime": {"kind": "constant", "constant_s": 4.0}},
    )
    host = ClientHost(
        cfg, [0], ClientOptions(BrokerOptions(), run_id="t", time_scale=SCALE), lambda cid: (None, None)
    )
    dev = host.devices[0]
    # AVL_TRAIN until 2 s, UN_AVL until 6 s, then AVL_TRAIN (config seconds).
    dev.trace = DeviceTrace.from_events([(2.0, Tier.UN_AVL), (6.0, Tier.AVL_TRAIN)], initial=Tier.AVL_TRAIN)
    dev.tier = Tier.AVL_TRAIN
    dev.session = "s1"  # as if registered
    link = FakeLink(host, results)
    dev.link = link  # type: ignore[assignment]
    return host, dev, link


def _task_msg(host: ClientHost, msg: wire.Message) -> None:
    host.inbox.put(Delivery(Address(Channel.TASK, 0), wire.encode(msg), Ack(1, 1, 1), "task/0"), 0)


def _train(task: int, size: int) -> wire.TrainTask:
    return wire.TrainTask(
        run="t",
        msg_id=f"s-{task}",
        sent_at=time.time(),
        client=0,
        task=task,
        version=0,
        weights=np.zeros(size, np.float32),
    )


def test_interrupted_task_pauses_and_resumes() -> None:
    host, _, link = _host(results=1)
    size = sum(p.numel() for p in host.trainer.model.parameters())
    started: list[float] = []  # trace time at which the computation of a task starts
    compute = host._compute

    def timed(d: Device, task: DeviceTask) -> ClientUpdate:
        started.append(host.trace_time())
        return compute(d, task)

    host._compute = timed  # type: ignore[method-assign]
    _task_msg(host, _train(7, size))
    host.serve(time.monotonic() + 60)
    kinds = [(type(m).__name__, getattr(m, "tier", None)) for _, m in link.sent]
    assert kinds == [("State", Tier.UN_AVL), ("State", Tier.AVL_TRAIN), ("Result", None)], kinds
    _, result = link.sent[-1]
    assert isinstance(result, wire.Result) and result.task == 7 and result.kind is TaskKind.TRAIN
    # 2 s of work before the interruption, the other 2 s after the client is back at 6 s: done at
    # about 8 s, not at 4 s; the reported duration is the task's runtime, as in the simulator.
    assert len(started) == 1 and 7.8 <= started[0] <= 10.0, started
    t_states = [t for t, m in link.sent[:2]]
    assert 1.8 <= t_states[0] <= 4.0 and 5.8 <= t_states[1] <= 8.0, t_states
    delta = result.update.delta
    assert result.update.duration == 4.0 and delta is not None and delta.shape == (size,)
    assert np.isfinite(delta).all() and delta.any()


def test_cancel_and_redelivery() -> None:
    host, _, link = _host(results=1)
    size = sum(p.numel() for p in host.trainer.model.parameters())
    _task_msg(host, _train(3, size))
    _task_msg(host, _train(3, size))  # a QoS 1 redelivery: run once
    _task_msg(host, _train(4, size))
    _task_msg(
        host, wire.Cancel(run="t", msg_id="s-9", sent_at=time.time(), client=0, task=3, reason="round ended")
    )
    _task_msg(host, _train(3, size))  # a late copy of a cancelled task: not run
    _task_msg(
        host,
        wire.EvalTask(
            run="other",
            msg_id="s-10",
            sent_at=time.time(),
            client=0,
            task=5,
            version=0,
            weights=np.zeros(size, np.float32),
        ),
    )  # another run: dropped
    junk = b"JUNK" + bytes(40)  # not the wire format
    host.inbox.put(Delivery(Address(Channel.TASK, 0), junk, Ack(1, 1, 1), "task/0"), 0)
    _task_msg(host, dataclasses.replace(_train(6, size), client=1))  # addressed to another client
    host.serve(time.monotonic() + 60)
    assert len(host.inbox) == 0  # every message was handled before the one result
    results = [m for _, m in link.sent if isinstance(m, wire.Result)]
    assert [r.task for r in results] == [4]
    assert host.tasks_done == 1
    assert host.protocol.dropped_by_kind == {"bad_magic": 1, "other_run": 1, "wrong_addressee": 1}


def test_data_plan_row_is_applied_once() -> None:
    """The first task bringing the client's row augments its data (the simulator's applier, seeds and
    time charge); later rows are not applied again."""
    cfg = resolve_config(
        None,
        "fedbuff",
        {
            "model": "mlp",
            "data_plan": "dafl",
            "partition": {"kind": "iid", "num_clients": 2},
            "runtime": {"kind": "constant", "constant_s": 4.0},
        },
    )
    host = ClientHost(
        cfg, [0], ClientOptions(BrokerOptions(), run_id="t", time_scale=0.01), lambda cid: (None, None)
    )
    dev = host.devices[0]
    dev.session = "s1"
    link = FakeLink(host, results=2)
    dev.link = link  # type: ignore[assignment]
    size = sum(p.numel() for p in host.trainer.model.parameters())
    before = len(dev.data)
    row = (3, 0, 0, 0, 0, 0, 0, 0, 0, 2)
    for task in (1, 2):
        _task_msg(
            host,
            wire.TrainTask(
                run="t",
                msg_id=f"s-{task}",
                sent_at=time.time(),
                client=0,
                task=task,
                version=0,
                plan=row,
                weights=np.zeros(size, np.float32),
            ),
        )
    host.serve(time.monotonic() + 60)
    assert len(dev.data) == before + 5 and dev.augmented
    results = [m for _, m in link.sent if isinstance(m, wire.Result)]
    assert [r.task for r in results] == [1, 2] and results[1].update.num_samples == before + 5
    assert host.plan_applier is not None
    charge = host.plan_applier.virtual_s[0]
    assert charge > 0 and results[0].update.duration == 4.0 + charge and results[1].update.duration == 4.0
