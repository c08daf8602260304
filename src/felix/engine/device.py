"""The device runner: one client's task queue as a sans-I/O state machine, shared by both shells.

The simulator (:mod:`felix.sim.simulation`) and the MQTT client (:mod:`felix.deploy.client`) drive the
same :class:`DeviceRunner`: they tell it what happened (a task arrived, the tier changed, a
completion timer fired, a task was cancelled, a result was computed) with the time ``now`` in
config seconds (the simulator's virtual clock; the client's trace time, wall time / ``time_scale``)
and do what it answers (:class:`Step`): set a completion timer, send results. It reads no clock,
does no I/O and imports no torch, so its behaviour is tested directly, in virtual time.

The rules (the FeLiX authors' clients, and the simulator's model of a checkpointed device):
- a task moves only as ``DEVICE_TRANSITIONS`` says, a (state, event) -> next state table like the
  server's ledger (``felix.core.ledger``); any other change raises ``IllegalTransition``:

  ====================  =================  ===============================================
  state                 event              next state
  ====================  =================  ===============================================
  (new)                 RECEIVED           QUEUED
  QUEUED                STARTED            RUNNING (its tier allows it, nothing else runs)
  RUNNING               TIER_BLOCKED       PAUSED (progress kept)
  PAUSED                TIER_ALLOWED       RUNNING
  RUNNING               WORK_DONE          COMPUTING (the shell computes its result)
  COMPUTING             RESULT_READY       HELD
  HELD                  SENT               SENT (now, or once the tier allows it)
  COMPUTING             COMPUTE_FAILED     FAILED (the shell reported the failure)
  QUEUED/RUNNING/PAUSED CANCEL_RECEIVED    CANCELLED
  ====================  =================  ===============================================

- tasks run one at a time, in arrival order; training runs only in ``AVL_TRAIN``, an eval in
  ``AVL_TRAIN`` or ``AVL_EVAL``;
- a task whose tier stops allowing it pauses, keeping its progress, and resumes when the tier
  allows it again; every (re)start draws a new token, so a completion timer set before a pause or
  a cancel is recognised as stale;
- a task id is run once: a redelivered task (MQTT QoS 1) and a task that arrives after its cancel
  are ignored;
- a result finished while the tier forbids sending it (``compute`` timing, where a task lasts as
  long as its computation and the tier may change meanwhile) is held until the tier allows;
- the data-plan row (DAFL / LB) is applied once, by the first TRAIN task carrying one, and its
  augmentation time is added to that task's duration;
- with a data feed (streaming data, :mod:`felix.stream`), a task's data is what the feed gives at
  the moment the task first starts (a paused task keeps it), and the task notes the arrival
  times of its oldest and newest sample (``data_span``), which its update carries.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from felix.core.ledger import IllegalTransition
from felix.core.types import TaskKind, Tier

if TYPE_CHECKING:
    from felix.client.trainer import ClientData
    from felix.privacy.local import LocalMechanism
    from felix.strategies.dataplans.plans import PlanClient

log = logging.getLogger("felix.engine.device")

R = TypeVar("R")

TASK_SEED_STRIDE = 1_000_003


def task_seed(run_seed: int, task_id: int) -> int:
    """The seed of a training task's generator: the same task trains the same way in either shell."""
    return run_seed * TASK_SEED_STRIDE + task_id


def can_run(tier: Tier, kind: TaskKind) -> bool:
    """Training needs ``AVL_TRAIN``; an eval also runs in ``AVL_EVAL``."""
    return tier is Tier.AVL_TRAIN or (kind is TaskKind.EVAL and tier is Tier.AVL_EVAL)


class DeviceState(str, Enum):
    """Where a task is on its device (the server's view of it is ``felix.core.types.TaskState``)."""

    QUEUED = "queued"  # received, waiting for the device and a tier that allows it
    RUNNING = "running"  # its work clock runs
    PAUSED = "paused"  # started, its tier stopped allowing it: progress kept
    COMPUTING = "computing"  # its work time is over; the shell computes its result
    HELD = "held"  # its result waits for a tier that allows sending it
    SENT = "sent"  # its result went to the shell to send
    FAILED = "failed"  # its computation failed (the shell reported it)
    CANCELLED = "cancelled"  # the server withdrew it before its work was done


class DeviceEvent(str, Enum):
    """What happens to a task on its device: the causes in ``DEVICE_TRANSITIONS``."""

    RECEIVED = "received"
    STARTED = "started"
    TIER_BLOCKED = "tier_blocked"
    TIER_ALLOWED = "tier_allowed"
    WORK_DONE = "work_done"  # its completion timer fired (with a current token)
    RESULT_READY = "result_ready"
    SENT = "sent"
    COMPUTE_FAILED = "compute_failed"
    CANCEL_RECEIVED = "cancel_received"


_D, _V = DeviceState, DeviceEvent
#: The legal changes of a task on its device: (state, event) -> next state; ``None``: not received yet.
DEVICE_TRANSITIONS: dict[tuple[DeviceState | None, DeviceEvent], DeviceState] = {
    (None, _V.RECEIVED): _D.QUEUED,
    (_D.QUEUED, _V.STARTED): _D.RUNNING,
    (_D.RUNNING, _V.TIER_BLOCKED): _D.PAUSED,
    (_D.PAUSED, _V.TIER_ALLOWED): _D.RUNNING,
    (_D.RUNNING, _V.WORK_DONE): _D.COMPUTING,
    (_D.COMPUTING, _V.RESULT_READY): _D.HELD,
    (_D.HELD, _V.SENT): _D.SENT,
    (_D.COMPUTING, _V.COMPUTE_FAILED): _D.FAILED,
    (_D.QUEUED, _V.CANCEL_RECEIVED): _D.CANCELLED,
    (_D.RUNNING, _V.CANCEL_RECEIVED): _D.CANCELLED,
    (_D.PAUSED, _V.CANCEL_RECEIVED): _D.CANCELLED,
}


def _move(cid: int, task: DeviceTask, event: DeviceEvent) -> None:
    """The one place a device task changes state."""
    state = DEVICE_TRANSITIONS.get((task.state, event))
    if state is None:
        raise IllegalTransition(
            f"client {cid}, task {task.task_id}: event {event.value} is not allowed in state {task.state.value}"
        )
    task.state = state


@dataclass
class DeviceTask:
    """A task as a device holds it: the model and aux it trains on and the work it costs. The
    server's record of the same task (its state, round, slot) is ``felix.core.types.Task``."""

    task_id: int
    kind: TaskKind
    weights: np.ndarray
    aux: dict[str, np.ndarray]  # a copy: the server's dict changes at every aggregation
    duration: float  # config seconds of work (0 under compute timing: the computation's own time)
    version: int = 0  # the model version it was dispatched with
    data_span: tuple[float, float] | None = None  # arrival times of its oldest and newest sample (a feed's)
    state: DeviceState = DEVICE_TRANSITIONS[None, DeviceEvent.RECEIVED]


class DataFeed(Protocol):
    """Where a streaming device's data comes from (:class:`felix.stream.feed.StreamFeed`): the
    samples it may train on at ``now`` and the arrival times of the oldest and newest of them."""

    def data_at(self, now: float) -> tuple[ClientData, tuple[float, float] | None]: ...


@dataclass(frozen=True)
class TaskRules:
    """How a shell times its tasks and applies data plans (one object for all of its devices)."""

    eval_fraction: float = 0.05  # an eval takes this share of the client's training time
    compute: bool = False  # a task lasts as long as its computation (the deployment's ``runtime: compute``)
    augment: Callable[[PlanClient, Sequence[int]], float] | None = None
    """Applies a data-plan row to the device (``PlanApplier``: changes its ``data`` and perhaps its
    ``runtime_s``) and returns the augmentation's virtual seconds."""
    privacy: LocalMechanism | None = None
    """What the device does to each result before it leaves (``privacy:`` on: clip, and under
    ``local`` noise; ``felix.privacy.setup.device_mechanism``)."""


@dataclass(frozen=True)
class Timer:
    """Complete the current task at config time ``at`` by calling ``complete(at, token)``; a token
    changed since (a pause or a cancel) makes the call a no-op."""

    at: float
    token: int


@dataclass(frozen=True)
class Held(Generic[R]):
    task: DeviceTask
    result: R


@dataclass
class Step(Generic[R]):
    """What the shell must do after a runner call: set ``timer``; send ``released`` now, in order."""

    timer: Timer | None = None
    released: list[Held[R]] = field(default_factory=list)


@dataclass(eq=False)
class DeviceRunner(Generic[R]):
    """One device's tasks (``R``: the shell's result type, sent when released). The shells'
    devices extend it with what only they need (the trace; the MQTT link and session)."""

    cid: int
    data: ClientData
    runtime_s: float  # config seconds of one training task
    tier: Tier
    state: dict[str, Any] = field(default_factory=dict)  # objective state kept between the client's tasks
    queue: deque[DeviceTask] = field(default_factory=deque)  # QUEUED tasks, in arrival order
    current: DeviceTask | None = None  # the RUNNING or PAUSED task
    started_at: float | None = None  # when the current task (re)started; None while paused
    remaining: float = 0.0  # config seconds of work left on the current task when it (re)started
    token: int = 0
    seen: set[int] = field(default_factory=set)  # task ids received or cancelled: each runs at most once
    held: list[Held[R]] = field(default_factory=list)  # HELD results, waiting for a tier that allows sending
    augmented: bool = False  # applied its data-plan row (once, on the first task bringing it)
    feed: DataFeed | None = None  # streaming data: ``data`` is refreshed from it when a task starts

    def can_run(self, kind: TaskKind) -> bool:
        return can_run(self.tier, kind)

    @property
    def running(self) -> DeviceTask | None:
        """The task whose clock runs now (not paused), for the simulator's cohorts."""
        return self.current if self.started_at is not None else None

    @property
    def due_at(self) -> float | None:
        """When the running task completes (None while idle or paused)."""
        return None if self.started_at is None else self.started_at + self.remaining

    # ------------------------------------------------------------------ inputs
    def receive(
        self,
        now: float,
        task_id: int,
        kind: TaskKind,
        weights: np.ndarray,
        rules: TaskRules,
        *,
        aux: dict[str, np.ndarray] | None = None,
        version: int = 0,
        plan: Sequence[int] = (),
    ) -> Step[R] | None:
        """A task arrived; None when its id was seen before (a redelivery, or cancelled already)."""
        if task_id in self.seen:
            return None
        self.seen.add(task_id)
        augment_s = 0.0
        if kind is TaskKind.TRAIN and plan and not self.augmented and rules.augment is not None:
            self.augmented = True  # augmentation (and its time) belongs to the first task with the row
            augment_s = rules.augment(self, plan)
            log.debug(
                "client %d: applied its data-plan row (%d samples, %.1f s)", self.cid, sum(plan), augment_s
            )
        if rules.compute:
            duration = 0.0
        elif kind is TaskKind.TRAIN:
            duration = augment_s + self.runtime_s  # the runtime after augmentation (it may follow the data)
        else:
            duration = self.runtime_s * rules.eval_fraction
        self.queue.append(DeviceTask(task_id, kind, weights, dict(aux or {}), duration, version))
        return Step(self._try_start(now))

    def set_tier(self, now: float, tier: Tier) -> Step[R] | None:
        """The device's tier is ``tier`` from ``now``; None when that is no change. A change pauses
        or resumes the current task, releases held results the tier now allows, and may start the
        next task."""
        if tier is self.tier:
            return None
        self.tier = tier
        step: Step[R] = Step()
        task = self.current
        if task is not None:
            if self.started_at is not None and not self.can_run(task.kind):  # pause, keep the progress
                _move(self.cid, task, DeviceEvent.TIER_BLOCKED)
                self.remaining -= now - self.started_at
                self.started_at = None
                self.token += 1
            elif self.started_at is None and self.can_run(task.kind):
                _move(self.cid, task, DeviceEvent.TIER_ALLOWED)
                step.timer = self._resume(now)
        else:
            step.timer = self._try_start(now)
        step.released = self._release()
        return step

    def complete(self, token: int) -> DeviceTask | None:
        """A completion timer fired: the finished task for the shell to compute (then :meth:`finish`),
        or None when the timer is stale."""
        if token != self.token or self.current is None:
            return None
        task, self.current, self.started_at = self.current, None, None
        _move(self.cid, task, DeviceEvent.WORK_DONE)
        return task

    def finish(self, now: float, task: DeviceTask, result: R) -> Step[R]:
        """``task``'s result is ready: sent now if the tier allows it, else held; the next task may start."""
        _move(self.cid, task, DeviceEvent.RESULT_READY)
        self.held.append(Held(task, result))
        return Step(self._try_start(now), self._release())

    def fail(self, now: float, task: DeviceTask) -> Step[R]:
        """Computing ``task`` failed (the shell reported it); the next queued task may start."""
        _move(self.cid, task, DeviceEvent.COMPUTE_FAILED)
        return Step(self._try_start(now))

    def cancel(self, now: float, task_id: int) -> Step[R]:
        """Drop a queued or running task; a delivery of it that comes later is not run."""
        self.seen.add(task_id)
        if self.current is not None and self.current.task_id == task_id:
            _move(self.cid, self.current, DeviceEvent.CANCEL_RECEIVED)
            self.current, self.started_at = None, None
            self.token += 1
            return Step(self._try_start(now))
        kept: deque[DeviceTask] = deque()
        for t in self.queue:
            if t.task_id == task_id:
                _move(self.cid, t, DeviceEvent.CANCEL_RECEIVED)
            else:
                kept.append(t)
        self.queue = kept
        return Step()

    # ------------------------------------------------------------------ internals
    def _try_start(self, now: float) -> Timer | None:
        if self.current is None and self.queue and self.can_run(self.queue[0].kind):
            self.current = self.queue.popleft()
            _move(self.cid, self.current, DeviceEvent.STARTED)
            self.remaining = self.current.duration
            if self.feed is not None:
                self.data, self.current.data_span = self.feed.data_at(now)
            return self._resume(now)
        return None

    def _resume(self, now: float) -> Timer:
        self.started_at = now
        self.token += 1
        return Timer(now + max(0.0, self.remaining), self.token)

    def _release(self) -> list[Held[R]]:
        if not self.held:
            return []
        out = [h for h in self.held if self.can_run(h.task.kind)]
        if out:
            self.held = [h for h in self.held if not self.can_run(h.task.kind)]
            for h in out:
                _move(self.cid, h.task, DeviceEvent.SENT)
        return out
