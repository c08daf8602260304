"""The task ledger: every task the orchestrator has issued, its state, its timer, which task holds
each client's slot, and the one table of legal state changes.

``TRANSITIONS`` maps (state, event) to the next state, h11-style: the event names the cause. A
task is opened by ``DISPATCHED``, ``IN_FLIGHT`` (it holds its client's slot). It loses the slot
by ``CLIENT_LEFT`` (``INTERRUPTED``: its client left its tier) or ``TIMER_FIRED`` (``TIMED_OUT``:
no reply within the task timeout); such a task stays open, because a late reply may still come
and be used (``LATE_RESULT``). It is closed ``DONE`` by its ``RESULT``, or ``CANCELLED`` when it
``FAILED`` on its client, was ``WITHDRAWN`` by the server, was ``NOT_SENT`` (held back for the
data plan and its client left meanwhile) or was ``SUPERSEDED`` (the one-late-task rule below).
The ledger's verbs take the event and refuse any pair the table lacks (``IllegalTransition``
naming state and event), so a new code path that would, say, finish a cancelled task fails at
once instead of double-counting an update.

Which task holds each client's slot is part of the same transitions: ``open`` takes the slot and
any change out of ``IN_FLIGHT`` frees it, in one place (``_move``), which also writes the
``ClientMap``'s ``in_flight`` column (attached as ``slots``; selection reads that column as an
array) and nowhere else does; a restored checkpoint rewrites the column from the open tasks. So
the ledger and the column cannot disagree.

Why one place: replays and late replies are decided here (a closed id is remembered as DONE or
CANCELLED, so a replayed result is told from a stale one), and the deployment shell's
checkpoints store exactly this state. Closed ids are remembered one by one only above a
watermark (the oldest task still holding a slot); below it every id that is not open is closed,
so the memory is bounded by the open tasks, not by the run's history.

Sans-I/O like the rest of ``felix.core``: time arrives as arguments.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from felix.core.refusals import Refusal
from felix.core.types import Task, TaskEvent, TaskKind, TaskState

# Closed task ids are remembered one by one only above a watermark (the oldest task still open):
# below it every id not open is closed. Compaction runs when this many ids are remembered.
CLOSED_COMPACT_AT = 4096

_S, _E = TaskState, TaskEvent
#: The legal state changes: (state, event) -> next state. ``None`` is a task not yet opened.
TRANSITIONS: dict[tuple[TaskState | None, TaskEvent], TaskState] = {
    (None, _E.DISPATCHED): _S.IN_FLIGHT,
    (_S.IN_FLIGHT, _E.CLIENT_LEFT): _S.INTERRUPTED,
    (_S.IN_FLIGHT, _E.TIMER_FIRED): _S.TIMED_OUT,
    (_S.IN_FLIGHT, _E.RESULT): _S.DONE,
    (_S.IN_FLIGHT, _E.FAILED): _S.CANCELLED,
    (_S.IN_FLIGHT, _E.WITHDRAWN): _S.CANCELLED,
    (_S.INTERRUPTED, _E.LATE_RESULT): _S.DONE,
    (_S.INTERRUPTED, _E.FAILED): _S.CANCELLED,
    (_S.INTERRUPTED, _E.WITHDRAWN): _S.CANCELLED,
    (_S.INTERRUPTED, _E.NOT_SENT): _S.CANCELLED,  # a held task has no timer: only its client can leave
    (_S.INTERRUPTED, _E.SUPERSEDED): _S.CANCELLED,
    (_S.TIMED_OUT, _E.LATE_RESULT): _S.DONE,
    (_S.TIMED_OUT, _E.FAILED): _S.CANCELLED,
    (_S.TIMED_OUT, _E.WITHDRAWN): _S.CANCELLED,
    (_S.TIMED_OUT, _E.SUPERSEDED): _S.CANCELLED,
}
#: States that close a task (it leaves the ledger's open tasks).
CLOSED_STATES = frozenset({_S.DONE, _S.CANCELLED})
#: States of an open task that lost its slot: a late reply may still come.
LATE_STATES = frozenset({_S.INTERRUPTED, _S.TIMED_OUT})

_KINDS = (TaskKind.TRAIN, TaskKind.EVAL)
_STATES = tuple(TaskState)


class IllegalTransition(RuntimeError):
    """A task was sent an event that its table (``TRANSITIONS``, or the device runner's
    ``DEVICE_TRANSITIONS``) does not allow in its state."""


class SlotColumn(Protocol):
    """Where the ledger publishes which task holds each client's slot (``ClientMap``'s column)."""

    def set_in_flight(self, client_id: int, task_id: int | None) -> None: ...

    def reset_in_flight(self, holders: Mapping[int, int]) -> None: ...


class TaskLedger:
    """Open tasks, closed task ids, task timers and late tasks.

    ``task_timeout_s``: each dispatched task's timer (None: no timers). ``one_late_task_per_client``
    (with ``accept_late``): each client keeps at most one open task that lost its slot; a newer
    one is closed at once (``SUPERSEDED``) and reported by ``take_expired`` so that the shell
    cancels it. ``slots``: the column that mirrors ``holder`` for selection (the orchestrator's
    ``ClientMap``), written only by this ledger.
    """

    def __init__(
        self,
        task_timeout_s: float | None = None,
        one_late_task_per_client: bool = False,
        accept_late: bool = True,
        slots: SlotColumn | None = None,
    ) -> None:
        self.task_timeout_s = task_timeout_s
        self.one_late_task_per_client = one_late_task_per_client
        self.accept_late = accept_late
        self._slots = slots
        self._holder: dict[int, int] = {}  # client -> its task holding the slot (IN_FLIGHT)
        self._open: dict[int, Task] = {}
        self._closed: dict[int, TaskState] = {}  # task id -> DONE / CANCELLED, above the watermark
        self._closed_below = 1  # every task id below it is open or closed
        self._next_id = 1
        self._timers: list[tuple[float, int]] = []
        self._late: dict[int, int] = {}  # client -> its task that lost its slot and may still answer
        self._expired: list[Task] = []  # tasks closed by the one-late-task rule, not yet reported
        self._train_in_flight = 0
        # round -> its training tasks holding a slot (a sync round's top-up reads it at every event)
        self._round_in_flight: dict[int, int] = {}

    # ------------------------------------------------------------------ reading
    def __contains__(self, task_id: object) -> bool:
        return task_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def get(self, task_id: int) -> Task | None:
        """The open task ``task_id``, or None."""
        return self._open.get(task_id)

    def task(self, task_id: int) -> Task:
        """The open task ``task_id`` (KeyError if it is not open)."""
        return self._open[task_id]

    def tasks(self) -> list[Task]:
        """The open tasks, in the order they were opened."""
        return list(self._open.values())

    @property
    def train_in_flight(self) -> int:
        """Training tasks holding a slot."""
        return self._train_in_flight

    @property
    def next_id(self) -> int:
        """The id the next task will get."""
        return self._next_id

    def holder(self, client_id: int) -> int | None:
        """The id of the task holding the client's slot, if any."""
        return self._holder.get(client_id)

    def closed_state(self, task_id: int) -> TaskState | None:
        """How ``task_id`` was closed (DONE or CANCELLED) if it is remembered one by one, else None."""
        return self._closed.get(task_id)

    def was_issued(self, task_id: int) -> bool:
        """``task_id`` is below the watermark: issued, and (when not open) closed."""
        return 0 < task_id < self._closed_below

    def round_in_flight(self, round_: int) -> int:
        """Training tasks of round ``round_`` holding a slot (counted as they open and leave
        ``IN_FLIGHT``: what ``round_tasks`` would filter, without the scan)."""
        return self._round_in_flight.get(round_, 0)

    def round_tasks(self, round_: int) -> list[Task]:
        """The open training tasks of round ``round_`` (a list: the caller may close them)."""
        return [t for t in self._open.values() if t.round == round_ and t.kind is TaskKind.TRAIN]

    def late_task(self, client_id: int) -> int | None:
        """The id of the client's open task that lost its slot (awaiting a late reply), if any."""
        tid = self._late.get(client_id)
        task = None if tid is None else self._open.get(tid)
        return None if task is None or task.holds_slot else tid

    def mismatch(self, task: Task, kind: TaskKind | None, version: int | None) -> tuple[Refusal, str] | None:
        """Why a result stating ``kind`` and model ``version`` does not answer the open ``task``
        (a train result for an eval task, or one computed on another version), else None; a
        field not stated (None) is not checked."""
        if kind is not None and kind is not task.kind:
            return Refusal.WRONG_KIND, f"{kind.value} result for a {task.kind.value} task"
        if version is not None and version != task.base_version:
            return (
                Refusal.WRONG_VERSION,
                f"result computed on version {version}, task was dispatched with version {task.base_version}",
            )
        return None

    def owing(self) -> np.ndarray:
        """Clients that still owe the reply of a task that lost its slot (their device runs it
        before any newer task)."""
        return np.fromiter((c for c in self._late if self.late_task(c) is not None), dtype=np.int64, count=-1)

    # ------------------------------------------------------------------ transitions
    def open(self, client_id: int, kind: TaskKind, base_version: int, round_: int, now: float) -> Task:
        """``DISPATCHED``: a new task, ``IN_FLIGHT`` and holding its client's slot, with the next id.
        Its timer starts with ``start_timer`` (a task held back for the data plan starts it when it
        is sent). A client holding a slot cannot be given a second task."""
        held = self._holder.get(client_id)
        if held is not None:
            raise IllegalTransition(
                f"client {client_id} already holds task {held}: a second {_E.DISPATCHED.value} is not allowed"
            )
        task = Task(
            self._next_id, client_id, kind, base_version, round_, now, TRANSITIONS[None, _E.DISPATCHED]
        )
        self._next_id += 1
        self._open[task.task_id] = task
        if kind is TaskKind.TRAIN:
            self._train_in_flight += 1
            self._round_in_flight[round_] = self._round_in_flight.get(round_, 0) + 1
        self._hold(client_id, task.task_id)
        return task

    def start_timer(self, task: Task, now: float) -> None:
        """The task's timeout runs from ``now`` (no-op without a task timeout)."""
        if self.task_timeout_s is not None:
            heapq.heappush(self._timers, (now + self.task_timeout_s, task.task_id))
            if len(self._timers) > 2 * len(self._open) + 64:
                self._compact_timers()

    def release(self, task: Task, event: TaskEvent) -> bool:
        """``event`` (``CLIENT_LEFT`` or ``TIMER_FIRED``) takes ``task``'s slot; it stays open for a
        late reply. Any event that would not leave it so is refused. Returns whether the task was
        closed at once by the one-late-task rule.

        With ``one_late_task_per_client`` each client keeps at most one such task open, so open
        tasks are bounded by the population, not the run's history: when the client already has
        one, this newer task is closed as well (``SUPERSEDED``; ``take_expired`` then reports it).
        A device runs its tasks in order, so the newer one has not started (the older holds the
        progress); a device that restarted has its old task failed by the shell, so it never blocks
        the newer ones.
        """
        self._move(task, event, LATE_STATES)
        old = self._late.get(task.client_id)
        prev = None if old is None or old == task.task_id else self._open.get(old)
        if self.one_late_task_per_client and self.accept_late and prev is not None and not prev.holds_slot:
            self.close(task, _E.SUPERSEDED)
            self._expired.append(task)
            return True
        self._late[task.client_id] = task.task_id
        return False

    def close(self, task: Task, event: TaskEvent) -> None:
        """``event`` ends ``task`` (``DONE`` or ``CANCELLED``; any event that would not is refused);
        its id is remembered for replays. Past ``CLOSED_COMPACT_AT`` remembered ids the watermark
        rises to the oldest task still holding a slot and the ids below it are forgotten (they stay
        closed: not open and below the mark)."""
        state = self._move(task, event, CLOSED_STATES)
        self._open.pop(task.task_id, None)
        self._closed[task.task_id] = state
        if len(self._closed) < CLOSED_COMPACT_AT:
            return
        # Tasks that lost their slot stay open below the mark (they are looked up among the open
        # tasks first), so a client that never answers does not pin the mark and grow the memory.
        mark = min((t for t, open_ in self._open.items() if open_.holds_slot), default=self._next_id)
        if mark > self._closed_below:
            self._closed_below = mark
            self._closed = {t: s for t, s in self._closed.items() if t >= mark}

    def _move(self, task: Task, event: TaskEvent, into: frozenset[TaskState]) -> TaskState:
        """The one place a task changes state, to one of ``into`` (the caller's verb); leaving
        ``IN_FLIGHT`` frees the client's slot."""
        state = TRANSITIONS.get((task.state, event))
        if state is None or state not in into:
            raise IllegalTransition(
                f"task {task.task_id}: event {event.value} is not allowed in state {task.state.value}"
                + ("" if state is None else f" by this verb (it leads to {state.value})")
            )
        if task.holds_slot:
            if task.kind is TaskKind.TRAIN:
                self._train_in_flight -= 1
                left = self._round_in_flight[task.round] - 1
                if left:
                    self._round_in_flight[task.round] = left
                else:
                    del self._round_in_flight[task.round]
            self._hold(task.client_id, None)
        task.state = state
        return state

    def _hold(self, client_id: int, task_id: int | None) -> None:
        """The one writer of slot ownership: ``task_id`` (None: no task) holds ``client_id``'s slot,
        here and in the attached column."""
        if task_id is None:
            del self._holder[client_id]
        else:
            self._holder[client_id] = task_id
        if self._slots is not None:
            self._slots.set_in_flight(client_id, task_id)

    def take_expired(self) -> list[Task]:
        """The tasks the one-late-task rule closed since the last call (the shell cancels them)."""
        expired, self._expired = self._expired, []
        return expired

    # ------------------------------------------------------------------ timers
    def next_timer(self) -> float | None:
        """When the earliest timer of a task still holding its slot fires (dead timers dropped)."""
        while self._timers:
            task = self._open.get(self._timers[0][1])
            if task is not None and task.holds_slot:
                return self._timers[0][0]
            heapq.heappop(self._timers)
        return None

    def due(self, now: float) -> Iterator[Task]:
        """The tasks holding a slot whose timer fired by ``now``, earliest first; the caller
        releases each (as it is yielded, so that the next one sees the change)."""
        while self._timers and self._timers[0][0] <= now:
            _, task_id = heapq.heappop(self._timers)
            task = self._open.get(task_id)
            if task is not None and task.holds_slot:
                yield task

    def _compact_timers(self) -> None:
        """Drop the timers of tasks that no longer hold a slot (they would fire as no-ops), so the
        heap holds about one entry per open task instead of one per task of the last timeout."""
        live = [
            (t, i) for t, i in self._timers if (task := self._open.get(i)) is not None and task.holds_slot
        ]
        heapq.heapify(live)
        self._timers = live

    # ------------------------------------------------------------------ checkpoints
    def reserve_ids(self, first: int) -> None:
        """Number the next tasks from ``first`` on (at least)."""
        self._next_id = max(self._next_id, int(first))

    def state_dict(self) -> dict[str, Any]:
        """The ledger's part of the orchestrator's checkpoint (its keys sit at the top level of
        ``Orchestrator.state_dict``, as before the ledger had a module of its own), as arrays."""
        tasks = list(self._open.values())
        n = len(tasks)
        return {
            "tasks": {
                "task_id": np.fromiter((t.task_id for t in tasks), dtype=np.int64, count=n),
                "client_id": np.fromiter((t.client_id for t in tasks), dtype=np.int64, count=n),
                "kind": np.fromiter((_KINDS.index(t.kind) for t in tasks), dtype=np.int8, count=n),
                "base_version": np.fromiter((t.base_version for t in tasks), dtype=np.int64, count=n),
                "round": np.fromiter((t.round for t in tasks), dtype=np.int64, count=n),
                "dispatched_at": np.fromiter((t.dispatched_at for t in tasks), dtype=np.float64, count=n),
                "state": np.fromiter((_STATES.index(t.state) for t in tasks), dtype=np.int8, count=n),
            },
            "closed_ids": np.fromiter(self._closed.keys(), dtype=np.int64, count=len(self._closed)),
            "closed_state": np.fromiter(
                (_STATES.index(s) for s in self._closed.values()), dtype=np.int8, count=len(self._closed)
            ),
            "closed_below": self._closed_below,
            "next_task": self._next_id,
            "timer_at": np.array([t for t, _ in self._timers], dtype=np.float64),
            "timer_task": np.array([i for _, i in self._timers], dtype=np.int64),
            "train_in_flight": self._train_in_flight,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s keys (read from the orchestrator's checkpoint)."""
        t = {k: np.asarray(v).tolist() for k, v in state["tasks"].items()}
        self._open = {}
        for i, tid in enumerate(t["task_id"]):
            self._open[tid] = Task(
                tid,
                t["client_id"][i],
                _KINDS[t["kind"][i]],
                t["base_version"][i],
                t["round"][i],
                t["dispatched_at"][i],
                _STATES[t["state"][i]],
            )
        self._late = {task.client_id: tid for tid, task in sorted(self._open.items()) if not task.holds_slot}
        self._holder = {task.client_id: tid for tid, task in self._open.items() if task.holds_slot}
        self._round_in_flight = dict(
            Counter(t.round for t in self._open.values() if t.holds_slot and t.kind is TaskKind.TRAIN)
        )
        if self._slots is not None:
            self._slots.reset_in_flight(self._holder)
        self._expired = []
        self._closed = {
            tid: _STATES[s]
            for tid, s in zip(
                np.asarray(state["closed_ids"]).tolist(),
                np.asarray(state["closed_state"]).tolist(),
                strict=True,
            )
        }
        self._closed_below = int(state["closed_below"])
        self._next_id = int(state["next_task"])
        self._timers = list(
            zip(np.asarray(state["timer_at"]).tolist(), np.asarray(state["timer_task"]).tolist(), strict=True)
        )
        self._train_in_flight = int(state["train_in_flight"])


__all__ = [
    "CLOSED_COMPACT_AT",
    "CLOSED_STATES",
    "LATE_STATES",
    "TRANSITIONS",
    "IllegalTransition",
    "SlotColumn",
    "TaskLedger",
]
