"""The shared device runner (felix.engine.device), driven directly and through the MQTT client's
message handling, in virtual time: a fake clock and a fake link, no broker and no sleeps."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from mqtt_support import one_torch_thread  # noqa: F401  (a fixture)

from felix.core.ledger import IllegalTransition
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.client import ClientHost, ClientOptions, Device
from felix.deploy.link import BrokerOptions
from felix.deploy.transport import Ack, Delivery
from felix.engine.device import (
    DEVICE_TRANSITIONS,
    DeviceEvent,
    DeviceRunner,
    DeviceState,
    DeviceTask,
    TaskRules,
    Timer,
    task_seed,
)
from felix.engine.setup import resolve_config
from felix.scenario.traces import DeviceTrace

TRAIN, EVAL = TaskKind.TRAIN, TaskKind.EVAL
W = np.zeros(3, np.float32)
PROFILE = TaskRules(eval_fraction=0.25)


def runner(tier: Tier = Tier.AVL_TRAIN, runtime_s: float = 10.0) -> DeviceRunner[str]:
    return DeviceRunner(0, None, runtime_s, tier)  # type: ignore[arg-type]  # the runner never reads data


def run_to_end(dev: DeviceRunner[str], timer: Timer | None) -> tuple[DeviceTask, list[str]]:
    """Fire ``timer`` and finish its task with the result ``"r<task id>"``; what was sent."""
    assert timer is not None
    task = dev.complete(timer.token)
    assert task is not None
    step = dev.finish(timer.at, task, f"r{task.task_id}")
    return task, [h.result for h in step.released]


# ---------------------------------------------------------------------------------------- runner
def test_training_pauses_keeping_its_progress_and_resumes() -> None:
    dev = runner()
    step = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert step is not None and step.timer is not None and step.timer.at == 10.0
    first = step.timer
    assert dev.running is not None and dev.due_at == 10.0
    paused = dev.set_tier(4.0, Tier.UN_AVL)  # 4 s done, 6 s left
    assert paused is not None and paused.timer is None and paused.released == []
    assert dev.running is None and dev.current is not None and dev.due_at is None
    assert dev.complete(first.token) is None  # the timer set before the pause is stale
    assert dev.set_tier(5.0, Tier.AVL_EVAL) is not None and dev.running is None  # training needs AVL_TRAIN
    back = dev.set_tier(9.0, Tier.AVL_TRAIN)
    assert back is not None and back.timer is not None and back.timer.at == 15.0 and dev.due_at == 15.0
    task, sent = run_to_end(dev, back.timer)
    assert task.task_id == 1 and task.duration == 10.0 and sent == ["r1"]
    assert dev.current is None and dev.set_tier(20.0, Tier.AVL_TRAIN) is None  # no change, nothing to do


def test_eval_runs_in_avl_eval_and_training_waits() -> None:
    dev = runner(Tier.AVL_EVAL)
    step = dev.receive(0.0, 1, EVAL, W, PROFILE)
    assert step is not None and step.timer == Timer(2.5, dev.token)  # runtime * eval_fraction
    queued = dev.receive(1.0, 2, TRAIN, W, PROFILE)
    assert queued is not None and queued.timer is None  # one task at a time
    task, sent = run_to_end(dev, step.timer)
    assert task.kind is EVAL and sent == ["r1"]  # an eval result may be sent in AVL_EVAL
    assert dev.current is None and len(dev.queue) == 1  # the training task waits for AVL_TRAIN
    start = dev.set_tier(3.0, Tier.AVL_TRAIN)
    assert start is not None and start.timer is not None and start.timer.at == 13.0
    assert dev.set_tier(4.0, Tier.AVL_EVAL) is not None and dev.running is None  # it pauses in AVL_EVAL


def test_an_eval_keeps_running_from_avl_train_to_avl_eval() -> None:
    dev = runner()
    step = dev.receive(0.0, 1, EVAL, W, PROFILE)
    assert step is not None and step.timer is not None
    change = dev.set_tier(1.0, Tier.AVL_EVAL)
    assert change is not None and change.timer is None and dev.running is not None  # not paused
    assert run_to_end(dev, step.timer)[1] == ["r1"]  # the original timer is still valid


def test_cancel_of_the_running_task_starts_the_next() -> None:
    dev = runner()
    first = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert first is not None and dev.receive(1.0, 2, TRAIN, W, PROFILE) is not None
    step = dev.cancel(3.0, 1)
    assert step.timer is not None and step.timer.at == 13.0
    assert first.timer is not None and dev.complete(first.timer.token) is None  # stale
    task, sent = run_to_end(dev, step.timer)
    assert task.task_id == 2 and sent == ["r2"]


def test_cancel_of_a_queued_task_and_a_task_arriving_after_its_cancel() -> None:
    dev = runner()
    first = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert first is not None and dev.receive(0.0, 2, TRAIN, W, PROFILE) is not None
    assert dev.cancel(1.0, 2).timer is None and not dev.queue
    assert dev.cancel(1.0, 3).timer is None  # the cancel overtook its task ...
    assert dev.receive(2.0, 3, TRAIN, W, PROFILE) is None  # ... which is then not run
    assert dev.cancel(2.0, 99).timer is None  # an unknown task: nothing happens
    task, sent = run_to_end(dev, first.timer)
    assert task.task_id == 1 and sent == ["r1"] and dev.current is None and not dev.queue


def test_a_redelivered_task_runs_once() -> None:
    dev = runner()
    step = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert dev.receive(0.5, 1, TRAIN, W, PROFILE) is None
    assert not dev.queue
    assert step is not None
    run_to_end(dev, step.timer)
    assert dev.receive(11.0, 1, TRAIN, W, PROFILE) is None  # not even after it finished


def test_compute_timing_holds_results_until_the_tier_allows_sending() -> None:
    dev = runner()
    rules = TaskRules(compute=True)
    train = dev.receive(0.0, 1, TRAIN, W, rules)
    assert train is not None and train.timer == Timer(0.0, dev.token)  # as long as its computation
    task = dev.complete(train.timer.token)
    assert task is not None and task.duration == 0.0
    assert dev.set_tier(2.0, Tier.UN_AVL) is not None  # the device left while computing
    assert dev.receive(2.0, 2, EVAL, W, rules) is not None  # queued: nothing runs while unavailable
    held = dev.finish(2.0, task, "r1")
    assert held.released == [] and held.timer is None and [h.result for h in dev.held] == ["r1"]
    evals = dev.set_tier(3.0, Tier.AVL_EVAL)  # an eval may run, a training result still may not be sent
    assert evals is not None and evals.released == [] and evals.timer is not None
    ev = dev.complete(evals.timer.token)
    assert ev is not None and [h.result for h in dev.finish(3.0, ev, "r2").released] == ["r2"]
    back = dev.set_tier(4.0, Tier.AVL_TRAIN)
    assert back is not None and [(h.task.task_id, h.result) for h in back.released] == [(1, "r1")]
    assert dev.held == []


def test_each_task_moves_through_the_device_table() -> None:
    """Every change the runner makes is a (state, event) pair of ``DEVICE_TRANSITIONS``: the states a
    task passes through on a pause, a held result, a cancel and a failure."""
    dev = runner()
    a = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert a is not None and dev.receive(0.0, 2, TRAIN, W, PROFILE) is not None
    first, second = dev.current, dev.queue[0]
    assert first is not None and (first.state, second.state) == (DeviceState.RUNNING, DeviceState.QUEUED)
    dev.set_tier(2.0, Tier.UN_AVL)
    assert first.state is DeviceState.PAUSED
    back = dev.set_tier(3.0, Tier.AVL_TRAIN)
    assert back is not None and first.state is DeviceState.RUNNING
    task = dev.complete(back.timer.token if back.timer else -1)
    assert task is first and task.state is DeviceState.COMPUTING
    dev.set_tier(11.0, Tier.UN_AVL)
    dev.finish(11.0, task, "r1")
    assert task.state is DeviceState.HELD
    dev.set_tier(12.0, Tier.AVL_TRAIN)  # sends it, starts the second
    assert task.state is DeviceState.SENT and second.state is DeviceState.RUNNING
    dev.cancel(13.0, 2)
    assert second.state is DeviceState.CANCELLED and dev.current is None
    third = dev.receive(14.0, 3, TRAIN, W, PROFILE)
    assert third is not None and third.timer is not None
    failed = dev.complete(third.timer.token)
    assert failed is not None
    dev.fail(24.0, failed)
    assert failed.state is DeviceState.FAILED


def test_the_device_table_refuses_other_changes() -> None:
    """A result for a task still running, a second result, a failure after sending: refused, named."""
    assert {s for s, _ in DEVICE_TRANSITIONS} == {None} | set(DeviceState) - {
        DeviceState.SENT,
        DeviceState.FAILED,
        DeviceState.CANCELLED,
    }
    assert {e for _, e in DEVICE_TRANSITIONS} == set(DeviceEvent)
    dev = runner()
    step = dev.receive(0.0, 1, TRAIN, W, PROFILE)
    assert step is not None and dev.current is not None
    running = dev.current
    with pytest.raises(IllegalTransition, match="task 1: event result_ready is not allowed in state running"):
        dev.finish(1.0, running, "r1")
    assert running.state is DeviceState.RUNNING and dev.held == []
    task, sent = run_to_end(dev, step.timer)
    assert sent == ["r1"]
    with pytest.raises(IllegalTransition, match="event result_ready is not allowed in state sent"):
        dev.finish(11.0, task, "again")
    with pytest.raises(IllegalTransition, match="event compute_failed is not allowed in state sent"):
        dev.fail(11.0, task)


def test_the_data_plan_row_is_applied_once_and_charged_to_its_task() -> None:
    calls: list[tuple[int, ...]] = []

    def augment(client: Any, row: Sequence[int]) -> float:
        calls.append(tuple(row))
        client.runtime_s = 12.0  # a per-sample runtime follows the grown data
        return 3.0

    rules = TaskRules(augment=augment)
    dev = runner()
    dev.receive(0.0, 1, TRAIN, W, rules)  # no row: nothing to apply
    dev.receive(0.0, 2, TRAIN, W, rules, plan=(2, 1))
    dev.receive(0.0, 3, TRAIN, W, rules, plan=(2, 1))  # every task of the client carries its row
    assert calls == [(2, 1)] and dev.augmented
    assert [t.duration for t in ([dev.current] if dev.current else []) + list(dev.queue)] == [
        10.0,
        15.0,
        12.0,
    ]
    dev2 = runner()
    dev2.receive(0.0, 1, TRAIN, W, TaskRules(compute=True, augment=augment), plan=(1,))
    assert dev2.augmented and dev2.current is not None and dev2.current.duration == 0.0  # compute: own time


def test_tasks_keep_what_they_were_sent() -> None:
    dev = runner()
    aux = {"h": np.ones(2)}
    dev.receive(0.0, 1, TRAIN, W, PROFILE, aux=aux, version=7)
    aux["h"] = np.zeros(2)  # the server's dict changes at the next aggregation
    aux["new"] = np.zeros(1)
    assert dev.current is not None and set(dev.current.aux) == {"h"} and dev.current.version == 7


# ---------------------------------------------------------------------------------------- client
class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeLink:
    """Records what the client publishes, at trace time."""

    def __init__(self, host: ClientHost) -> None:
        self.host = host
        self.sent: list[tuple[float, wire.Message]] = []

    def send(self, channel: Channel, payload: bytes) -> None:
        self.sent.append((self.host.trace_time(), wire.decode(payload)))

    def log(self) -> list[tuple[float, str, Any]]:
        return [
            (round(t, 9), type(m).__name__, m.tier if isinstance(m, wire.State) else getattr(m, "task", None))
            for t, m in self.sent
        ]


SCALE = 0.5  # wall seconds per config second: virtual times are in config seconds all the same


def _host(trace: DeviceTrace, **opts: Any) -> tuple[ClientHost, FakeClock, FakeLink]:
    cfg = resolve_config(
        None,
        "fedbuff",
        {"model": "mlp", "partition": {"num_clients": 2}, "runtime": {"kind": "constant", "constant_s": 4.0}},
    )
    clock = FakeClock()
    host = ClientHost(
        cfg,
        [0],
        ClientOptions(BrokerOptions(), run_id="t", time_scale=SCALE, **opts),
        lambda cid: (None, None),
        clock=clock,
    )
    clock.t = host._mono_at(0.0)  # trace time 0 exactly
    dev = host.devices[0]
    dev.trace, dev.tier = trace, trace.tier_at(0.0)
    dev.session = "s1"  # as if registered
    link = FakeLink(host)
    dev.link = link  # type: ignore[assignment]
    host.start_timers()
    return host, clock, link


def _advance(host: ClientHost, clock: FakeClock, until: float) -> None:
    """Jump the clock from timer to timer up to trace time ``until``, firing each."""
    end = host._mono_at(until)
    while (t := host.next_timer()) is not None and t <= end:
        clock.t = max(clock.t, t)
        host.run_timers()
    clock.t = max(clock.t, end)


def _send(host: ClientHost, msg: wire.Message) -> None:
    host.handle(0, Delivery(Address(Channel.TASK, 0), wire.encode(msg), Ack(1, 1, 1), "task/0"))


def _weights(host: ClientHost) -> np.ndarray:
    return np.zeros(sum(p.numel() for p in host.trainer.model.parameters()), np.float32)


def _train(host: ClientHost, task: int, **kw: Any) -> wire.TrainTask:
    return wire.TrainTask(
        run="t",
        msg_id=f"s-{task}",
        sent_at=time.time(),
        client=0,
        task=task,
        version=0,
        weights=_weights(host),
        **kw,
    )


def _cancel(task: int) -> wire.Cancel:
    return wire.Cancel(
        run="t", msg_id=f"c-{task}", sent_at=time.time(), client=0, task=task, reason="round ended"
    )


BREAK = DeviceTrace.from_events([(2.0, Tier.UN_AVL), (6.0, Tier.AVL_TRAIN)], initial=Tier.AVL_TRAIN)
ALWAYS = DeviceTrace.from_events([], initial=Tier.AVL_TRAIN)


@pytest.mark.usefixtures("one_torch_thread")
def test_client_pauses_a_task_while_away_and_publishes_it_later() -> None:
    host, clock, link = _host(BREAK)
    _send(host, _train(host, 7))
    _advance(host, clock, 20.0)
    # 2 s of work, away from 2 s to 6 s, the other 2 s after: the result at 8 s, not at 4 s.
    assert link.log() == [(2.0, "State", Tier.UN_AVL), (6.0, "State", Tier.AVL_TRAIN), (8.0, "Result", 7)]
    result = link.sent[-1][1]
    assert isinstance(result, wire.Result) and result.kind is TaskKind.TRAIN
    assert result.update.duration == 4.0  # the task's runtime, as in the simulator
    # trained with the per-task seed both shells use
    expected = host.trainer.train(
        _weights(host),
        host.devices[0].data,
        {},
        {},
        torch.Generator().manual_seed(task_seed(host.cfg.seed, 7)),
    )
    delta = result.update.delta
    assert delta is not None and np.array_equal(delta, expected.delta) and delta.any()


@pytest.mark.usefixtures("one_torch_thread")
def test_client_cancel_and_redelivery() -> None:
    host, clock, link = _host(ALWAYS)
    _send(host, _train(host, 3))
    _send(host, _train(host, 3))  # a QoS 1 redelivery: run once
    _send(host, _train(host, 4))
    _advance(host, clock, 1.0)
    _send(host, _cancel(3))  # task 3 was running: task 4 starts now
    _send(host, _train(host, 3))  # a late copy of the cancelled task: not run
    _advance(host, clock, 20.0)
    assert link.log() == [(5.0, "Result", 4)] and host.tasks_done == 1
    _send(host, _train(host, 4))  # a redelivery after the result: not run again
    _advance(host, clock, 40.0)
    assert host.tasks_done == 1 and host.next_timer() is None


@pytest.mark.usefixtures("one_torch_thread")
def test_client_in_compute_mode_holds_a_result_until_it_may_send_it() -> None:
    """``runtime: compute``: a task takes as long as its computation; one that ends while the
    client is away is published when it is back."""
    host, clock, link = _host(BREAK, runtime="compute")
    compute = host._compute

    def slow(dev: Device, task: DeviceTask) -> ClientUpdate:
        clock.t += 3.0 * SCALE  # the computation takes 3 config seconds
        return compute(dev, task)

    host._compute = slow  # type: ignore[method-assign]
    _advance(host, clock, 1.0)
    _send(host, _train(host, 5))
    _advance(host, clock, 20.0)
    # computed from 1 s to 4 s; away since 2 s (seen when the computation ends): held until 6 s
    assert link.log() == [(4.0, "State", Tier.UN_AVL), (6.0, "State", Tier.AVL_TRAIN), (6.0, "Result", 5)]
    result = link.sent[-1][1]
    assert isinstance(result, wire.Result) and result.update.duration == pytest.approx(3.0)


@pytest.mark.usefixtures("one_torch_thread")
def test_client_runs_an_eval_while_available_for_evaluation_only() -> None:
    host, clock, link = _host(DeviceTrace.from_events([], initial=Tier.AVL_EVAL))
    _send(
        host,
        wire.EvalTask(
            run="t", msg_id="s-1", sent_at=time.time(), client=0, task=1, version=0, weights=_weights(host)
        ),
    )
    _send(host, _train(host, 2))
    _send(host, _train(host, 3))
    _advance(host, clock, 20.0)
    eval_s = 4.0 * host.cfg.runtime.eval_fraction
    assert link.log() == [(eval_s, "Result", 1)]  # training needs AVL_TRAIN: it waits
    assert [t.task_id for t in host.devices[0].queue] == [2, 3]
    _send(host, _cancel(2))  # a queued task is dropped
    assert [t.task_id for t in host.devices[0].queue] == [3]


@pytest.mark.usefixtures("one_torch_thread")
def test_client_reports_a_failed_task_and_runs_the_next() -> None:
    host, clock, link = _host(ALWAYS)
    compute = host._compute

    def flaky(dev: Device, task: DeviceTask) -> ClientUpdate:
        if task.task_id == 1:
            raise ValueError("broken weights")
        return compute(dev, task)

    host._compute = flaky  # type: ignore[method-assign]
    _send(host, _train(host, 1))
    _send(host, _train(host, 2))
    _advance(host, clock, 20.0)
    assert link.log() == [(4.0, "Failed", 1), (8.0, "Result", 2)] and host.tasks_done == 1
    failed = link.sent[0][1]
    assert isinstance(failed, wire.Failed) and "broken weights" in failed.reason
