"""The task ledger on its own: the (state, event) transition table, the slot each task holds and
the ClientMap column it writes, timers and expiry, late tasks, the one-late-task rule, the
closed-id watermark and the round trip of its checkpoint state (and a checkpoint of the format
written before the table named events)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from felix.core.client_map import ClientMap, ClientRecord
from felix.core.ledger import (
    CLOSED_COMPACT_AT,
    CLOSED_STATES,
    LATE_STATES,
    TRANSITIONS,
    IllegalTransition,
    TaskLedger,
)
from felix.core.types import Task, TaskEvent, TaskKind, TaskState, Tier

S = TaskState
E = TaskEvent


def _task(ledger: TaskLedger, client: int = 0, kind: TaskKind = TaskKind.TRAIN, now: float = 0.0) -> Task:
    task = ledger.open(client, kind, base_version=0, round_=0, now=now)
    ledger.start_timer(task, now)
    return task


def test_table_names_every_state_and_event_and_closed_states_are_final() -> None:
    assert {s for s, _ in TRANSITIONS} == {None, *(set(TaskState) - CLOSED_STATES)}
    assert {e for _, e in TRANSITIONS} == set(TaskEvent)
    assert {nxt for (s, _), nxt in TRANSITIONS.items() if s is S.IN_FLIGHT} == set(TaskState) - {S.IN_FLIGHT}
    assert [k for k, nxt in TRANSITIONS.items() if nxt is S.IN_FLIGHT] == [(None, E.DISPATCHED)]
    for late in LATE_STATES:  # a task that lost its slot is answered late or withdrawn, never re-slotted
        assert {nxt for (s, _), nxt in TRANSITIONS.items() if s is late} == CLOSED_STATES
    assert TRANSITIONS[S.IN_FLIGHT, E.RESULT] is S.DONE and (S.IN_FLIGHT, E.LATE_RESULT) not in TRANSITIONS
    assert (S.TIMED_OUT, E.NOT_SENT) not in TRANSITIONS  # a held task has no timer


def _send(ledger: TaskLedger, task: Task, event: TaskEvent, verb: str) -> None:
    if verb == "release":
        ledger.release(task, event)
    else:
        ledger.close(task, event)


@pytest.mark.parametrize("path", [p for n in (1, 2) for p in itertools.product(list(TaskEvent), repeat=n)])
def test_every_event_sequence_obeys_the_table(path: tuple[TaskEvent, ...]) -> None:
    """Each sequence of one or two events on a dispatched task succeeds exactly when every step is
    in the table and sent through the verb of its next state (``release`` to a late state, ``close``
    to a closed one); a refused step, named by state and event, leaves the task as it was."""
    ledger = TaskLedger(task_timeout_s=10.0)
    task = _task(ledger)
    for event in path:
        state, nxt = task.state, TRANSITIONS.get((task.state, event))
        good = "release" if nxt in LATE_STATES else "close"
        for verb in ("release", "close"):
            if nxt is None or verb != good:
                with pytest.raises(
                    IllegalTransition, match=f"event {event.value} is not allowed in state {state.value}"
                ):
                    _send(ledger, task, event, verb)
                assert task.state is state and (ledger.holder(0) is not None) == (state is S.IN_FLIGHT)
        if nxt is None:
            return
        _send(ledger, task, event, good)
        assert task.state is nxt and ledger.holder(0) is None
        assert (task.task_id in ledger) == (nxt not in CLOSED_STATES)


def _map(n: int) -> ClientMap:
    m = ClientMap()
    for cid in range(n):
        m.add(ClientRecord(client_id=cid, num_samples=1, tier=Tier.AVL_TRAIN, reported_tier=Tier.AVL_TRAIN))
    return m


def test_the_slot_column_is_written_by_the_ledgers_transitions() -> None:
    """The ClientMap's in_flight column mirrors which task holds each slot: set by DISPATCHED, freed
    by any event that leaves IN_FLIGHT; a second task for a busy client is refused."""
    m = _map(3)
    ledger = TaskLedger(task_timeout_s=5.0, slots=m)
    a, b = _task(ledger, 0), _task(ledger, 1)
    assert (m[0].in_flight, m[1].in_flight, m[2].in_flight) == (a.task_id, b.task_id, None)
    assert m.idle_in(Tier.AVL_TRAIN).tolist() == [2]
    with pytest.raises(IllegalTransition, match=f"client 0 already holds task {a.task_id}"):
        _task(ledger, 0)
    ledger.release(a, E.CLIENT_LEFT)
    assert m[0].in_flight is None and ledger.holder(0) is None
    c = _task(ledger, 0)  # free again; its old task still waits for a late reply
    ledger.close(b, E.FAILED)
    assert (m[0].in_flight, m[1].in_flight) == (c.task_id, None)
    assert m.idle_in(Tier.AVL_TRAIN).tolist() == [1, 2]


def test_a_restored_ledger_rewrites_the_slot_column() -> None:
    """The column is derived from the ledger's open tasks on load, whatever the map held."""
    m = _map(4)
    ledger = TaskLedger(slots=m)
    a, b = _task(ledger, 1), _task(ledger, 2)
    ledger.release(b, E.TIMER_FIRED)
    saved = ledger.state_dict()
    other = _map(4)
    TaskLedger(slots=other).load_state_dict(saved)  # the map's own column said nobody was busy
    assert [other[c].in_flight for c in range(4)] == [None, a.task_id, None, None]
    assert other.idle_in(Tier.AVL_TRAIN).tolist() == [0, 2, 3]
    other.set_in_flight(3, 99)  # a stale entry is cleared too
    back = TaskLedger(slots=other)
    back.load_state_dict(saved)
    assert [other[c].in_flight for c in range(4)] == [None, a.task_id, None, None]
    assert back.holder(1) == a.task_id and back.late_task(2) == b.task_id


def test_a_checkpoint_in_the_format_written_before_events_still_resumes() -> None:
    """The ledger's keys as written when its table listed next states only (states by their index in
    TaskState): three open tasks (one holding its slot, one interrupted, one timed out) and two
    closed ids; the restored ledger goes on from there."""
    old = {
        "tasks": {
            "task_id": np.array([7, 8, 9], dtype=np.int64),
            "client_id": np.array([0, 1, 2], dtype=np.int64),
            "kind": np.array([0, 0, 1], dtype=np.int8),  # TRAIN, TRAIN, EVAL
            "base_version": np.array([3, 2, 3], dtype=np.int64),
            "round": np.array([3, 2, 3], dtype=np.int64),
            "dispatched_at": np.array([10.0, 6.0, 9.0]),
            "state": np.array([0, 1, 2], dtype=np.int8),  # IN_FLIGHT, INTERRUPTED, TIMED_OUT
        },
        "closed_ids": np.array([5, 6], dtype=np.int64),
        "closed_state": np.array([4, 3], dtype=np.int8),  # DONE, CANCELLED
        "closed_below": 5,
        "next_task": 10,
        "timer_at": np.array([15.0], dtype=np.float64),
        "timer_task": np.array([7], dtype=np.int64),
        "train_in_flight": 1,
    }
    m = _map(3)
    ledger = TaskLedger(task_timeout_s=5.0, slots=m)
    ledger.load_state_dict(old)
    assert [(t.task_id, t.state) for t in ledger.tasks()] == [
        (7, S.IN_FLIGHT),
        (8, S.INTERRUPTED),
        (9, S.TIMED_OUT),
    ]
    assert ledger.closed_state(5) is S.DONE and ledger.closed_state(6) is S.CANCELLED and ledger.was_issued(4)
    assert [m[c].in_flight for c in range(3)] == [7, None, None] and ledger.train_in_flight == 1
    ledger.close(ledger.task(8), E.LATE_RESULT)
    with pytest.raises(IllegalTransition, match="event result is not allowed in state timed_out"):
        ledger.close(ledger.task(9), E.RESULT)
    assert [t.task_id for t in ledger.due(15.0)] == [7]
    ledger.release(ledger.task(7), E.TIMER_FIRED)
    assert ledger.train_in_flight == 0 and m[0].in_flight is None and _task(ledger, 0).task_id == 10
    assert ledger.state_dict().keys() == old.keys()


def test_train_in_flight_counts_slot_holders_only() -> None:
    ledger = TaskLedger()
    a, b = _task(ledger, 0), _task(ledger, 1)
    e = _task(ledger, 2, TaskKind.EVAL)
    assert ledger.train_in_flight == 2
    ledger.release(a, E.CLIENT_LEFT)
    assert ledger.train_in_flight == 1
    ledger.close(a, E.LATE_RESULT)  # a late reply: the slot was already freed
    ledger.close(e, E.RESULT)
    assert ledger.train_in_flight == 1
    ledger.close(b, E.WITHDRAWN)
    assert ledger.train_in_flight == 0 and len(ledger) == 0


def test_round_in_flight_is_the_scan_of_the_rounds_slot_holders() -> None:
    """The per-round count a sync round's top-up reads at every event equals the scan it replaces,
    through every way a task leaves its slot, and after a restore."""
    rng = np.random.default_rng(0)
    ledger = TaskLedger(one_late_task_per_client=True)

    def scan(r: int) -> int:
        return sum(t.holds_slot for t in ledger.round_tasks(r))

    rounds = range(4)
    for _ in range(400):
        holding = [t for t in ledger.tasks() if t.holds_slot]
        late = [t for t in ledger.tasks() if not t.holds_slot]
        move = rng.integers(4)
        if move == 0 or not holding:
            free = [c for c in range(12) if ledger.holder(c) is None]
            if free:
                kind = TaskKind.EVAL if rng.random() < 0.2 else TaskKind.TRAIN
                ledger.open(int(rng.choice(free)), kind, 0, int(rng.choice(rounds)), 0.0)
        elif move == 1:
            ledger.release(holding[rng.integers(len(holding))], E.CLIENT_LEFT)
        elif move == 2:
            event = [E.RESULT, E.WITHDRAWN, E.FAILED][rng.integers(3)]
            ledger.close(holding[rng.integers(len(holding))], event)
        elif late:
            ledger.close(late[rng.integers(len(late))], E.LATE_RESULT)
        assert [ledger.round_in_flight(r) for r in rounds] == [scan(r) for r in rounds]
    assert sum(scan(r) for r in rounds) > 0  # some are still holding: the restore has work
    back = TaskLedger(one_late_task_per_client=True)
    back.load_state_dict(ledger.state_dict())
    assert [back.round_in_flight(r) for r in rounds] == [scan(r) for r in rounds]


def test_timers_fire_in_order_and_skip_tasks_that_lost_their_slot() -> None:
    ledger = TaskLedger(task_timeout_s=5.0)
    a = _task(ledger, 0, now=0.0)
    b = _task(ledger, 1, now=1.0)
    c = _task(ledger, 2, now=2.0)
    ledger.release(b, E.CLIENT_LEFT)  # its timer is dead now
    assert ledger.next_timer() == 5.0
    fired = []
    for task in ledger.due(6.5):
        fired.append(task.task_id)
        ledger.release(task, E.TIMER_FIRED)
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
    ledger.release(a, E.TIMER_FIRED)
    assert ledger.late_task(7) == a.task_id
    assert ledger.owing().tolist() == [7]
    ledger.close(a, E.LATE_RESULT)  # the late reply came
    assert ledger.late_task(7) is None and ledger.owing().size == 0


def test_one_late_task_per_client_expires_the_newer_one() -> None:
    ledger = TaskLedger(one_late_task_per_client=True, accept_late=True)
    old = _task(ledger, 3)
    ledger.release(old, E.CLIENT_LEFT)
    new = _task(ledger, 3)
    assert ledger.release(new, E.TIMER_FIRED) is True
    assert new.state is S.CANCELLED and new.task_id not in ledger
    assert ledger.take_expired() == [new] and ledger.take_expired() == []
    assert ledger.late_task(3) == old.task_id  # the older one, which holds the device's progress
    assert ledger.closed_state(new.task_id) is S.CANCELLED
    # Off (the simulator's default), both stay open for their late replies.
    free = TaskLedger(one_late_task_per_client=False)
    old = _task(free, 3)
    free.release(old, E.CLIENT_LEFT)
    new = _task(free, 3)
    assert free.release(new, E.TIMER_FIRED) is False and len(free) == 2 and free.take_expired() == []


def test_closed_ids_are_remembered_then_compacted_below_the_watermark() -> None:
    ledger = TaskLedger()
    pinned = _task(ledger, 0)  # holds its slot throughout: the watermark cannot pass it
    done = []
    for _ in range(3):
        done.append(_task(ledger, 1))
        ledger.close(done[-1], E.RESULT)
    assert ledger.closed_state(done[0].task_id) is S.DONE
    assert not ledger.was_issued(done[0].task_id)  # remembered one by one, not below the mark yet
    for i in range(CLOSED_COMPACT_AT):
        ledger.close(_task(ledger, 2 + i % 5), E.WITHDRAWN if i % 2 else E.RESULT)
    assert len(ledger.state_dict()["closed_ids"]) == CLOSED_COMPACT_AT + 3  # pinned by the open task
    ledger.close(pinned, E.RESULT)  # nothing holds a slot now: the mark rises to the next id
    assert len(ledger.state_dict()["closed_ids"]) == 0
    ledger.close(_task(ledger, 1), E.RESULT)
    assert len(ledger.state_dict()["closed_ids"]) == 1
    assert ledger.was_issued(done[0].task_id) and ledger.closed_state(done[0].task_id) is None
    assert not ledger.was_issued(ledger.next_id)


def test_reserve_ids_only_moves_forward() -> None:
    ledger = TaskLedger()
    _task(ledger, 0)
    ledger.reserve_ids(1000)
    assert _task(ledger, 1).task_id == 1000
    ledger.reserve_ids(5)
    assert _task(ledger, 2).task_id == 1001


def test_state_round_trip_keeps_tasks_timers_late_tasks_and_closed_ids() -> None:
    ledger = TaskLedger(task_timeout_s=4.0)
    tasks = [_task(ledger, c, TaskKind.EVAL if c == 4 else TaskKind.TRAIN, now=float(c)) for c in range(6)]
    ledger.release(tasks[1], E.CLIENT_LEFT)
    ledger.release(tasks[2], E.TIMER_FIRED)
    ledger.close(tasks[3], E.RESULT)
    ledger.close(tasks[5], E.WITHDRAWN)
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
