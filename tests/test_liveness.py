"""Liveness and bounded-state rules of the orchestrator (issue 11, review findings 1 and 2).

- async: when every available client is blocked by the rejoin rule and nothing is in flight, the
  run must not stall: a wakeup is set and the blocked clients train again;
- tasks that lost their slot (timed out, interrupted) stay open for a late reply, but at most one
  per client: open tasks and remembered closed ids do not grow with the run's history.
"""

from __future__ import annotations

import numpy as np

from felix.core.commands import CancelTask, DispatchTrain, NewModelVersion
from felix.core.events import ClientRegistered, TaskFailed, TaskFinished, Tick
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, Tier
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.random import RandomSelector

DIM = 4


def make(**kw) -> Orchestrator:
    cfg = OrchestratorConfig(mode="async", **{"one_late_task_per_client": True, **kw})
    return Orchestrator(
        cfg, np.zeros(DIM, np.float32), RandomSelector(), FedBuffAggregator(), np.random.default_rng(0)
    )


def register(o: Orchestrator, n: int) -> list:
    out = []
    for c in range(n):
        out += o.handle(ClientRegistered(0.0, c, num_samples=100, tier=Tier.AVL_TRAIN))
    return out


def upd() -> ClientUpdate:
    return ClientUpdate(
        num_samples=10, stat_utility=1.0, loss=0.5, duration=5.0, delta=np.ones(DIM, np.float32)
    )


def trains(cmds: list) -> list[DispatchTrain]:
    return [c for c in cmds if isinstance(c, DispatchTrain)]


def test_async_does_not_stall_when_every_client_dropped_its_task() -> None:
    o = make(concurrency=2, agg_goal=3, task_timeout_s=90.0)
    first = trains(register(o, 2))
    assert len(first) == 2
    out = []
    for i, d in enumerate(first):
        out += o.handle(TaskFailed(1.0 + i, d.client_id, d.task_id, "device error"))
    assert not trains(out)  # the rejoin rule: not picked again in this version ...
    wake = o.next_wakeup()
    assert wake is not None, "nothing in flight, nobody selectable and no wakeup: the run stalls for good"
    again = trains(o.handle(Tick(wake)))
    assert {d.client_id for d in again} == {0, 1}  # ... but not forever


def test_async_does_not_stall_after_every_task_timed_out() -> None:
    o = make(concurrency=2, agg_goal=3, task_timeout_s=10.0)
    register(o, 2)
    t = 0.0
    dispatched = 0
    for _ in range(6):  # timeouts block both clients; the stall rule lets them train again
        wake = o.next_wakeup()
        assert wake is not None, "the run stalled"
        t = max(t, wake)
        dispatched += len(trains(o.handle(Tick(t))))
    assert dispatched >= 2


def test_timed_out_tasks_do_not_accumulate() -> None:
    """Client 0 never answers; the others always do. Its timed-out tasks must not pile up in the
    orchestrator's open tasks (nor pin the closed-id watermark) for the rest of the run."""
    o = make(concurrency=2, agg_goal=1, task_timeout_s=10.0)
    pending = trains(register(o, 4))
    t = 0.0
    silent_tasks = 0
    cancels: list[CancelTask] = []
    for _ in range(400):
        t += 11.0
        out = []
        for d in pending:
            if d.client_id == 0:
                silent_tasks += 1
            else:
                out += o.handle(TaskFinished(t, d.client_id, d.task_id, upd()))
        out += o.handle(Tick(t + 0.5))
        pending = trains(out)
        cancels += [c for c in out if isinstance(c, CancelTask)]
    assert silent_tasks > 50
    assert o.version > 100
    assert len(o.tasks()) <= 4 + 2, f"{len(o.tasks())} open tasks after {silent_tasks} timeouts"
    assert len(o.ledger.state_dict()["closed_ids"]) <= 8192
    assert all(c.client_id == 0 for c in cancels) and len(cancels) >= silent_tasks - 2


def test_late_reply_of_the_latest_timed_out_task_is_still_applied() -> None:
    o = make(concurrency=1, agg_goal=1, task_timeout_s=10.0)
    (d,) = trains(register(o, 1))
    o.handle(Tick(11.0))  # timed out; nobody else: after the stall rule it is dispatched again
    wake = o.next_wakeup()
    assert wake is not None
    (d2,) = trains(o.handle(Tick(wake)))
    assert d2.client_id == 0 and d2.task_id != d.task_id
    out = o.handle(TaskFinished(wake + 1.0, 0, d.task_id, upd()))  # the first task's late reply
    assert [c for c in out if isinstance(c, NewModelVersion)]


def test_a_client_keeps_one_slotless_task_and_a_restart_frees_it() -> None:
    o = make(concurrency=1, agg_goal=1, task_timeout_s=10.0)
    (d,) = trains(register(o, 1))
    o.handle(Tick(11.0))
    (d2,) = trains(o.handle(Tick(o.next_wakeup() or 0.0)))
    out = o.handle(
        Tick(32.0)
    )  # d2 (dispatched at 21) times out too: d (which the device runs first) stays open
    assert [(c.task_id, c.client_id) for c in out if isinstance(c, CancelTask)] == [(d2.task_id, 0)]
    assert o.late_task(0) == d.task_id and {t.task_id for t in o.tasks()} >= {d.task_id}
    o.handle(TaskFailed(33.0, 0, d.task_id, "client restarted"))  # what the MQTT shell sends on a restart
    assert o.late_task(0) is None and d.task_id not in {t.task_id for t in o.tasks()}
    assert o.stats.train_dropped == 2  # counted once each, when they lost their slots
