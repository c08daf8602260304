"""The task ledger on its own: the transition table, timers and expiry, late tasks, the one-late-task
rule, the closed-id watermark and the round trip of its checkpoint state."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from felix.core.ledger import (
    CLOSED_COMPACT_AT,
    CLOSED_STATES,
    LATE_STATES,
    TRANSITIONS,
    IllegalTransition,
    TaskLedger,
)
from felix.core.types import Task, TaskKind, TaskState

S = TaskState


def _task(ledger: TaskLedger, client: int = 0, kind: TaskKind = TaskKind.TRAIN, now: float = 0.0) -> Task:
    task = ledger.open(client, kind, base_version=0, round_=0, now=now)
    ledger.start_timer(task, now)
    return task


def _to(ledger: TaskLedger, task: Task, state: TaskState) -> None:
    """Move ``task`` to ``state`` through the ledger's public verbs."""
    if state in LATE_STATES:
        ledger.release(task, state)
    else:
        ledger.close(task, state)


def test_table_covers_every_state_and_closed_states_are_final() -> None:
    assert set(TRANSITIONS) == set(TaskState)
    assert all(not TRANSITIONS[s] for s in CLOSED_STATES)
    assert TRANSITIONS[S.IN_FLIGHT] == {S.INTERRUPTED, S.TIMED_OUT, S.CANCELLED, S.DONE}
    for late in LATE_STATES:  # a task that lost its slot is answered late or withdrawn, never re-slotted
        assert TRANSITIONS[late] == CLOSED_STATES


@pytest.mark.parametrize("path", [p for n in (1, 2) for p in itertools.product(list(TaskState), repeat=n)])
def test_every_path_obeys_the_table(path: tuple[TaskState, ...]) -> None:
    """Each sequence of one or two moves from IN_FLIGHT succeeds exactly when every step is in the
    table; a refused step leaves the task as it was."""
    ledger = TaskLedger(task_timeout_s=10.0)
    task = _task(ledger)
    state = S.IN_FLIGHT
    for target in path:
        if target is S.IN_FLIGHT or target not in TRANSITIONS[state]:
            with pytest.raises(IllegalTransition):
                _to(ledger, task, target)
            assert task.state is state
            return
        _to(ledger, task, target)
        state = target
        assert task.state is state
        assert (task.task_id in ledger) == (state not in CLOSED_STATES)


def test_train_in_flight_counts_slot_holders_only() -> None:
    ledger = TaskLedger()
    a, b = _task(ledger, 0), _task(ledger, 1)
    e = _task(ledger, 2, TaskKind.EVAL)
    assert ledger.train_in_flight == 2
    ledger.release(a, S.INTERRUPTED)
    assert ledger.train_in_flight == 1
    ledger.close(a, S.DONE)  # a late reply: the slot was already freed
    ledger.close(e, S.DONE)
    assert ledger.train_in_flight == 1
    ledger.close(b, S.CANCELLED)
    assert ledger.train_in_flight == 0 and len(ledger) == 0


def test_timers_fire_in_order_and_skip_tasks_that_lost_their_slot() -> None:
    ledger = TaskLedger(task_timeout_s=5.0)
    a = _task(ledger, 0, now=0.0)
    b = _task(ledger, 1, now=1.0)
    c = _task(ledger, 2, now=2.0)
    ledger.release(b, S.INTERRUPTED)  # its timer is dead now
    assert ledger.next_timer() == 5.0
    fired = []
    for task in ledger.due(6.5):
        fired.append(task.task_id)
        ledger.release(task, S.TIMED_OUT)
    assert fired == [a.task_id]
    assert ledger.next_timer() == 7.0  # b's dead timer was dropped on the way
    assert [t.task_id for t in ledger.due(7.0)] == [c.task_id]


def test_no_timeout_means_no_timers() -> None:
    ledger = TaskLedger(task_timeout_s=None)
    _task(ledger)
    assert ledger.next_timer() is None and list(ledger.due(1e9)) == []


def test_late_task_and_owing() -> None:
    ledger = TaskLedger()
    a = _task(ledger, 7)
    assert ledger.late_task(7) is None
    ledger.release(a, S.TIMED_OUT)
    assert ledger.late_task(7) == a.task_id
    assert ledger.owing().tolist() == [7]
    ledger.close(a, S.DONE)  # the late reply came
    assert ledger.late_task(7) is None and ledger.owing().size == 0


def test_one_late_task_per_client_expires_the_newer_one() -> None:
    ledger = TaskLedger(one_late_task_per_client=True, accept_late=True)
    old = _task(ledger, 3)
    ledger.release(old, S.INTERRUPTED)
    new = _task(ledger, 3)
    assert ledger.release(new, S.TIMED_OUT) is True
    assert new.state is S.CANCELLED and new.task_id not in ledger
    assert ledger.take_expired() == [new] and ledger.take_expired() == []
    assert ledger.late_task(3) == old.task_id  # the older one, which holds the device's progress
    assert ledger.closed_state(new.task_id) is S.CANCELLED
    # Off (the simulator's default), both stay open for their late replies.
    free = TaskLedger(one_late_task_per_client=False)
    old, new = _task(free, 3), _task(free, 3)
    free.release(old, S.INTERRUPTED)
    assert free.release(new, S.TIMED_OUT) is False and len(free) == 2 and free.take_expired() == []


def test_closed_ids_are_remembered_then_compacted_below_the_watermark() -> None:
    ledger = TaskLedger()
    pinned = _task(ledger, 0)  # holds its slot throughout: the watermark cannot pass it
    done = [_task(ledger, 1) for _ in range(3)]
    for t in done:
        ledger.close(t, S.DONE)
    assert ledger.closed_state(done[0].task_id) is S.DONE
    assert not ledger.was_issued(done[0].task_id)  # remembered one by one, not below the mark yet
    for i in range(CLOSED_COMPACT_AT):
        ledger.close(_task(ledger, 2 + i % 5), S.CANCELLED if i % 2 else S.DONE)
    assert len(ledger.state_dict()["closed_ids"]) == CLOSED_COMPACT_AT + 3  # pinned by the open task
    ledger.close(pinned, S.DONE)  # nothing holds a slot now: the mark rises to the next id
    assert len(ledger.state_dict()["closed_ids"]) == 0
    ledger.close(_task(ledger, 1), S.DONE)
    assert len(ledger.state_dict()["closed_ids"]) == 1
    assert ledger.was_issued(done[0].task_id) and ledger.closed_state(done[0].task_id) is None
    assert not ledger.was_issued(ledger.next_id)


def test_reserve_ids_only_moves_forward() -> None:
    ledger = TaskLedger()
    _task(ledger)
    ledger.reserve_ids(1000)
    assert _task(ledger).task_id == 1000
    ledger.reserve_ids(5)
    assert _task(ledger).task_id == 1001


def test_state_round_trip_keeps_tasks_timers_late_tasks_and_closed_ids() -> None:
    ledger = TaskLedger(task_timeout_s=4.0)
    tasks = [_task(ledger, c, TaskKind.EVAL if c == 4 else TaskKind.TRAIN, now=float(c)) for c in range(6)]
    ledger.release(tasks[1], S.INTERRUPTED)
    ledger.release(tasks[2], S.TIMED_OUT)
    ledger.close(tasks[3], S.DONE)
    ledger.close(tasks[5], S.CANCELLED)
    saved = ledger.state_dict()

    back = TaskLedger(task_timeout_s=4.0)
    back.load_state_dict(saved)
    assert [(t.task_id, t.client_id, t.kind, t.state, t.dispatched_at) for t in back.tasks()] == [
        (t.task_id, t.client_id, t.kind, t.state, t.dispatched_at) for t in ledger.tasks()
    ]
    assert back.train_in_flight == ledger.train_in_flight == 1
    assert back.late_task(1) == tasks[1].task_id and back.late_task(2) == tasks[2].task_id
    assert (
        back.closed_state(tasks[3].task_id) is S.DONE and back.closed_state(tasks[5].task_id) is S.CANCELLED
    )
    assert back.next_id == ledger.next_id and back.next_timer() == ledger.next_timer() == 4.0
    assert [t.task_id for t in back.due(10.0)] == [tasks[0].task_id, tasks[4].task_id]
    again = back.state_dict()
    assert again.keys() == saved.keys()
    # Same arrays after a reload (timers aside: due() above consumed the fired ones).
    for key in ("closed_ids", "closed_state", "closed_below", "next_task", "train_in_flight"):
        assert np.array_equal(np.asarray(again[key]), np.asarray(saved[key]))
