"""The simulation shell: a virtual clock and event heap around the orchestrator.

Devices follow their availability trace and runtime; a device that leaves its tier mid-task
pauses (its progress kept, as a checkpoint would) and resumes when it is back, so its update
arrives late and stale, as on real devices. Local training really runs, in-process; only time is
virtual. What a device does with its tasks (queue, pause and resume, cancel, durations, the data
plan, task seeds) is the shared device runner's (:mod:`felix.engine.device`), the same code the
MQTT client runs: this shell only turns the runner's timers into heap events and its released
results into ``TaskFinished`` events, and trains. With secure aggregation, a task that carries a
model version its groups have not yet unmasked (``RunController.release_time``: the virtual time
of the protocol's exchanges) reaches its device at the version's release.

A training task's result depends only on its dispatched weights, its client's data, its client's
objective state and its seed, so it may be computed at any moment before its completion event.
With ``cohort_size`` 1 a task trains when it completes (cancelled work costs nothing). With a
cohort, the first completion that finds its task in no group either trains it alone (fewer than
``min_cohort`` running training tasks are in no group) or groups it with the other running training
tasks in no group (soonest completion first, up to the cohort size). A remote executor trains a
group whole. A local cohort trainer keeps a live stack instead, which takes every running training
task at each advance, grouped or not, and steps them in lockstep only until the completed task is
done (:mod:`felix.client.cohort`): the others keep their progress and go on with the tasks that
join later, so a long task does not step alone and each step trains as many tasks as are running
(continuous batching). A task that stepped in the stack and then, by the rule, trains alone drops
its stacked progress. Each result waits for its own completion event.

Only a device's current task is trained early, so all its earlier tasks are finished and its
state is final; the new state is committed at completion, and a cancelled task's result (or its
part-trained row) is dropped unseen, so cancellation changes nothing. A device whose data changes
(augmentation) before completion is retrained. Which tasks train alone and which in a cohort is
the same rule whatever the executor, and a task's cohort arithmetic does not depend on the others
in its pass, so the live stack gives the runs the whole-group passes give (tests/test_cohort.py).
The exception is a convolution on a CPU, which takes another kernel for a client stepping alone
than for a stack of them (a few ulps): there the company a task keeps can move the last bits.
"""

from __future__ import annotations

import heapq
import logging
import sys
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from felix.client.cohort import CohortTask
from felix.client.trainer import ClientData, LocalTrainer
from felix.core.commands import (
    CancelTask,
    Command,
    DispatchEval,
    DispatchTrain,
    UpdateRejected,
)
from felix.core.events import ClientRegistered, Event, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Orchestrator
from felix.core.types import ClientUpdate, TaskKind
from felix.engine.controller import RunController
from felix.engine.device import DeviceRunner, DeviceTask, Step, TaskRules, task_seed
from felix.engine.heap import gc_frozen
from felix.privacy.local import LocalMechanism
from felix.scenario.traces import DeviceTrace
from felix.strategies.dataplans.plans import PlanClient

log = logging.getLogger("felix.sim")

_TIER, _DONE, _WAKE, _RELEASE = 0, 1, 2, 3


@dataclass(eq=False)
class SimDevice(DeviceRunner[ClientUpdate]):
    """A simulated device: the shared task runner, following its availability trace."""

    trace: DeviceTrace = field(kw_only=True)


class CohortExecutor(Protocol):
    """Where a cohort's tasks train (``run.executor``): in this process (:class:`~felix.client.cohort.CohortTrainer`) or on
    Ray actors (:class:`felix.sim.ray_cohorts.RayCohortExecutor`). ``train`` returns one
    update per task, in order, and writes each client's new objective state into its task."""

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]: ...

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[ClientUpdate]: ...


@runtime_checkable
class LiveCohort(CohortExecutor, Protocol):
    """A cohort executor with a live stack (:class:`~felix.client.cohort.CohortTrainer`): tasks join
    it and train in lockstep, each finishing when :meth:`advance` reaches it."""

    def join(self, key: int, task: CohortTask) -> None: ...

    def advance(self, key: int) -> dict[int, ClientUpdate]: ...

    def drop(self, key: int) -> bool: ...

    def live(self, key: int) -> CohortTask | None: ...

    @property
    def live_count(self) -> int: ...


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class SimSettings:
    seed: int = 0
    eval_fraction: float = 0.05  # an eval task takes this share of the client's training time
    progress: bool = False
    cohort_size: int = 1  # tasks trained together (1: each at its completion, sequentially)
    min_cohort: int = 2  # fewer ready tasks than this train sequentially


@dataclass
class _Trained:
    """A result computed before its completion: kept until then, dropped if the task is cancelled
    (``state``: the client's objective state after a training task)."""

    update: ClientUpdate
    state: dict
    data: ClientData  # the data it was trained on: a device whose data changed since is retrained


@dataclass
class SimOutcome:
    virtual_time_s: float
    wall_time_s: float
    stop_reason: str
    rejected: list[UpdateRejected]
    train_seconds: float  # wall seconds spent inside local training (for the overhead benchmark)
    trained_unused: int = 0  # tasks trained early in a cohort whose result was dropped (cancelled, retrained)
    probe_seconds: float = 0.0  # wall seconds spent computing eval tasks' results (the same benchmark)


class Simulation:
    """The virtual-clock shell. Run control (evaluations, stop rules, byte accounting) is the
    ``controller``'s (:mod:`felix.engine.controller`): every event goes through it."""

    def __init__(
        self,
        orch: Orchestrator,
        devices: list[SimDevice],
        trainer: LocalTrainer,
        controller: RunController,
        settings: SimSettings,
        on_train: Callable[[SimDevice, DeviceTask], None] | None = None,
        augment: Callable[[PlanClient, Sequence[int]], float] | None = None,
        privacy: LocalMechanism | None = None,
        cohort: CohortExecutor | None = None,
        registration: Callable[[int], tuple[int, tuple[int, ...]]] | None = None,
    ) -> None:
        self.orch = orch
        # Streaming data: what a client registers (its most samples and their class split), in
        # place of its fixed data's size and class counts.
        self._registration = registration
        self.devices = devices
        self.trainer = trainer
        self.cohort = cohort if settings.cohort_size > 1 else None
        # Resolved once: isinstance against a runtime-checkable Protocol costs tens of microseconds.
        self._live: LiveCohort | None = self.cohort if isinstance(self.cohort, LiveCohort) else None
        self._trained: dict[int, _Trained] = {}  # by task id
        # Tasks in a local cohort trainer's live stack, by task id: the state copy the trainer
        # writes into, and the data the task trains on.
        self._live_state: dict[int, dict] = {}
        self._live_data: dict[int, ClientData] = {}
        self._grouped: set[int] = set()  # running training tasks put in a group (_advance_live)
        # The devices whose task's clock runs, by client id: a cohort is formed from these, so
        # forming one costs what is running, not the registered population.
        self._running: dict[int, SimDevice] = {}
        self._unused = 0
        self._probed: dict[int, _Trained] = {}
        self.ctl = controller
        self.cfg = settings
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._wake_at: float | None = None
        self._rejected: list[UpdateRejected] = []
        # Tasks held back until the version they carry is released (secure aggregation's exchanges),
        # by heap token.
        self._held: dict[int, DispatchTrain | DispatchEval] = {}
        self._train_seconds = 0.0
        self._probe_seconds = 0.0
        self._on_train = on_train
        # How tasks last and data plans apply (augment: a data-plan row -> its virtual seconds).
        self._rules = TaskRules(eval_fraction=settings.eval_fraction, augment=augment, privacy=privacy)
        self._shown = -1

    # ------------------------------------------------------------------ heap
    def _push(self, t: float, kind: int, cid: int = -1, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, cid, token))

    def _deliver(self, event: Event) -> None:
        self._apply(self.ctl.handle(event))
        wake = self.orch.next_wakeup()
        if wake is not None and (self._wake_at is None or wake < self._wake_at or self._wake_at <= self.now):
            self._wake_at = max(wake, self.now)
            self._push(self._wake_at, _WAKE)

    # ------------------------------------------------------------------ run
    def run(self) -> SimOutcome:
        wall0 = time.perf_counter()
        self.ctl.start()
        for dev in self.devices:
            if self._registration is None:
                size, counts = len(dev.data), tuple(dev.data.class_counts(self.trainer.num_classes).tolist())
            else:
                size, counts = self._registration(dev.cid)
            self._deliver(ClientRegistered(0.0, dev.cid, size, dev.tier, counts))
            self._schedule_tier(dev)
        try:
            with gc_frozen():
                self._loop()
        finally:
            if isinstance(self.cohort, _Closable):  # remote executors end their workers with the run
                self.cohort.close()
        self.ctl.stop("no_more_events")  # unless a stop rule ended the run
        self.ctl.finish(self.now)
        if self.cfg.progress:
            sys.stderr.write("\n")
        return SimOutcome(
            self.now,
            time.perf_counter() - wall0,
            self.ctl.stop_reason or "no_more_events",
            self._rejected,
            self._train_seconds,
            self._unused,
            self._probe_seconds,
        )

    def _loop(self) -> None:
        while self._heap and self.ctl.stop_reason is None:
            t, _, kind, cid, token = heapq.heappop(self._heap)
            if self.ctl.past_time_limit(t):
                self.now = self.ctl.max_time_s
                break
            self.now = t
            if kind == _TIER:
                self._on_tier(self.devices[cid])
            elif kind == _DONE:
                self._on_done(self.devices[cid], token)
            elif kind == _RELEASE:
                self._apply([self._held.pop(token)])
            elif t == self._wake_at:
                self._wake_at = None
                self._deliver(Tick(t))
            self._progress()

    def _progress(self) -> None:
        if self.cfg.progress and self.ctl.rec.rows and self.orch.version != self._shown:
            self._shown = self.orch.version
            r = self.ctl.rec.rows[-1]
            end = "\r" if sys.stderr.isatty() else "\n"
            if end == "\r" or self._shown % 50 == 0:
                sys.stderr.write(
                    f"  t={self.now:9.0f}s  version={self._shown:5d}  accuracy={r.accuracy:.4f}{end}"
                )

    # ------------------------------------------------------------------ devices
    def _schedule_tier(self, dev: SimDevice) -> None:
        nxt = dev.trace.next_change(self.now)
        if nxt is not None and nxt[0] <= self.ctl.max_time_s:
            self._push(nxt[0], _TIER, dev.cid)

    def _on_tier(self, dev: SimDevice) -> None:
        new = dev.trace.tier_at(self.now)
        self._schedule_tier(dev)
        step = dev.set_tier(self.now, new)
        if step is None:
            return
        self._follow(dev, step)  # a simulated result is never held: it completes only where it may be sent
        self._deliver(TierChanged(self.now, dev.cid, new))

    def _follow(self, dev: SimDevice, step: Step[ClientUpdate] | None) -> None:
        """Do what the device's runner asks: set its completion timer, deliver its released results.
        Every call that changes a runner's task is followed here, so ``_running`` is kept here."""
        if step is None:
            return
        if dev.running is not None:
            self._running[dev.cid] = dev
        else:
            self._running.pop(dev.cid, None)
        if step.timer is not None:
            self._push(step.timer.at, _DONE, dev.cid, step.timer.token)
        for held in step.released:
            t = held.task
            self._deliver(TaskFinished(self.now, dev.cid, t.task_id, held.result, t.kind, t.version))

    def _on_done(self, dev: SimDevice, token: int) -> None:
        task = dev.complete(token)
        if task is None:
            return
        if task.kind is TaskKind.TRAIN:
            if self._on_train is not None:
                self._on_train(dev, task)
            t0 = time.perf_counter()
            done = self._trained.pop(task.task_id, None)
            changed = done is not None and done.data is not dev.data
            if changed:
                done, self._unused = None, self._unused + 1
            if self._live_data.get(task.task_id, dev.data) is not dev.data:  # its data changed mid-way
                self._unused += self._drop_live(task.task_id)
                changed = True
            if changed:  # trained again, and grouped again
                self._grouped.discard(task.task_id)
            if self._live is not None:
                done = self._advance_live(self._live, dev, task, done)
            elif done is None and self.cohort is not None:
                done = self._train_cohort(dev, task)
            if done is None:
                upd = self.trainer.train(task.weights, dev.data, dev.state, task.aux, self._generator(task))
            else:
                upd = done.update
                dev.state.clear()
                dev.state.update(done.state)
            upd.data_span = task.data_span
            self._train_seconds += time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            probed = self._probed.pop(task.task_id, None)
            if probed is None or probed.data is not dev.data:
                probed = self._probe_cohort(dev, task) if self.cohort is not None else None
            upd = probed.update if probed is not None else self.trainer.probe(task.weights, dev.data)
            self._probe_seconds += time.perf_counter() - t0
        if self._rules.privacy is not None:  # clipped (and noised under local DP) on the device
            upd = self._rules.privacy.release(dev.cid, task.task_id, upd)
        upd.duration = task.duration
        self._follow(dev, dev.finish(self.now, task, upd))

    def _drop_live(self, task_id: int) -> bool:
        """Take ``task_id`` out of the live cohort stack unfinished; whether it was there."""
        if self._live is None or not self._live.drop(task_id):
            return False
        self._live_state.pop(task_id)
        self._live_data.pop(task_id)
        return True

    def _generator(self, task: DeviceTask) -> torch.Generator:
        return torch.Generator().manual_seed(task_seed(self.cfg.seed, task.task_id))

    def _ready(
        self, dev: SimDevice, task: DeviceTask, done: Container[int]
    ) -> list[tuple[SimDevice, DeviceTask]]:
        """``(dev, task)`` and the other devices' running tasks of the same kind that have no result
        yet, soonest completion first, up to the cohort size; paused tasks wait (they are the
        likeliest to time out)."""
        others = [
            (d, t)
            for d in self._running.values()
            if d is not dev and (t := d.running) is not None and t.kind is task.kind and t.task_id not in done
        ]
        others.sort(key=lambda p: (p[0].due_at, p[0].cid))  # type: ignore[arg-type, return-value]
        return [(dev, task), *others[: self.cfg.cohort_size - 1]]

    def _train_cohort(self, dev: SimDevice, task: DeviceTask) -> _Trained | None:
        """Train ``task`` (``dev``'s, just completed) with the other ready tasks in a remote executor's
        whole-group pass; None when too few are ready for a vectorised pass to pay."""
        assert self.cohort is not None
        group = self._ready(dev, task, self._trained)
        if len(group) < self.cfg.min_cohort:
            return None
        cohort = [self._cohort_task(d, t) for d, t in group]
        updates = self.cohort.train(cohort)
        for (d, t), c, u in zip(group[1:], cohort[1:], updates[1:]):
            self._trained[t.task_id] = _Trained(u, c.state, d.data)
        return _Trained(updates[0], cohort[0].state, dev.data)

    def _advance_live(
        self, live: LiveCohort, dev: SimDevice, task: DeviceTask, done: _Trained | None
    ) -> _Trained | None:
        """``task``'s result from the live stack (``done``: already finished there); None when it
        trains alone.

        Which tasks train alone is decided as for a whole-group executor, so the runs are the same
        whatever the executor: at the completion of a task not yet in a group, the group is the task
        and the other running training tasks not in one (soonest completion first, up to the cohort
        size), and fewer than ``min_cohort`` train alone (``_grouped`` holds the tasks so grouped).
        The stack itself takes every running training task at each advance, grouped or not, so
        each lockstep step trains as many tasks as are running; a task that then trains alone
        drops its stacked progress (counted in ``trained_unused``)."""
        tid = task.task_id
        if tid not in self._grouped:
            group = self._ready(dev, task, self._grouped)
            if len(group) < self.cfg.min_cohort:
                self._unused += done is not None or self._drop_live(tid)
                return None
            self._grouped.update(t.task_id for _, t in group)
        self._grouped.discard(tid)
        if done is not None:
            return done
        ready = self._ready(dev, task, self._trained.keys() | self._live_data.keys())  # the task first
        first = live.live(tid) is None
        room = max(self.cfg.cohort_size - live.live_count, 1 if first else 0)
        for d, t in ready[0 if first else 1 :][:room]:
            live.join(t.task_id, self._cohort_task(d, t))
            self._live_data[t.task_id] = d.data
        mine: _Trained | None = None
        for task_id, upd in live.advance(tid).items():
            state = self._live_state.pop(task_id)
            trained = _Trained(upd, state, self._live_data.pop(task_id))
            if task_id == tid:
                mine = trained
            else:
                self._trained[task_id] = trained
        return mine

    def _cohort_task(self, dev: SimDevice, task: DeviceTask) -> CohortTask:
        state = dict(dev.state)  # the task's own copy: committed only at its completion
        if self._live is not None:
            self._live_state[task.task_id] = state
        return CohortTask(task.weights, dev.data, state, task.aux, self._generator(task))

    def _probe_cohort(self, dev: SimDevice, task: DeviceTask) -> _Trained | None:
        assert self.cohort is not None
        group = self._ready(dev, task, self._probed)
        if len(group) < self.cfg.min_cohort:
            return None
        updates = self.cohort.probe([t.weights for _, t in group], [d.data for d, _ in group])
        for (d, t), u in zip(group[1:], updates[1:]):
            self._probed[t.task_id] = _Trained(u, {}, d.data)
        return _Trained(updates[0], {}, dev.data)

    # ------------------------------------------------------------------ commands
    def _apply(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, DispatchTrain | DispatchEval) and self._hold(cmd):
                continue
            if isinstance(cmd, DispatchTrain):
                dev = self.devices[cmd.client_id]
                self._follow(
                    dev,
                    dev.receive(
                        self.now,
                        cmd.task_id,
                        TaskKind.TRAIN,
                        cmd.weights,
                        self._rules,
                        aux=cmd.aux,
                        version=cmd.version,
                        plan=cmd.plan,
                    ),
                )
            elif isinstance(cmd, DispatchEval):
                dev = self.devices[cmd.client_id]
                self._follow(
                    dev,
                    dev.receive(
                        self.now, cmd.task_id, TaskKind.EVAL, cmd.weights, self._rules, version=cmd.version
                    ),
                )
            elif isinstance(cmd, CancelTask):
                self._cancel(self.devices[cmd.client_id], cmd.task_id)
            elif isinstance(cmd, UpdateRejected):
                log.warning(
                    "rejected update from client %d task %d: %s", cmd.client_id, cmd.task_id, cmd.reason
                )
                self._rejected.append(cmd)

    def _hold(self, cmd: DispatchTrain | DispatchEval) -> bool:
        """Whether ``cmd`` waits for the release of the version it carries (then it is delivered at
        that time: a device cannot start on a model that its secure aggregation has not unmasked)."""
        at = self.ctl.release_time(cmd.version)
        if at is None or at <= self.now:
            return False
        self._seq += 1
        self._held[self._seq] = cmd
        heapq.heappush(self._heap, (at, self._seq, _RELEASE, cmd.client_id, self._seq))
        return True

    def _cancel(self, dev: SimDevice, task_id: int) -> None:
        self._unused += self._trained.pop(task_id, None) is not None or self._drop_live(task_id)
        self._grouped.discard(task_id)
        self._probed.pop(task_id, None)
        self._follow(dev, dev.cancel(self.now, task_id))


def make_devices(
    datas: list[ClientData], runtimes: np.ndarray, trace_for: Callable[[int], DeviceTrace]
) -> list[SimDevice]:
    return [
        SimDevice(k, d, float(runtimes[k]), trace_for(k).tier_at(0.0), trace=trace_for(k))
        for k, d in enumerate(datas)
    ]
