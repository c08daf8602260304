"""The simulation shell: a virtual clock and event heap around the orchestrator.

Devices follow their availability trace and runtime; a device that leaves its tier mid-task
pauses (its progress kept, as a checkpoint would) and resumes when it is back, so its update
arrives late and stale, as on real devices. Local training really runs, in-process; only time is
virtual.

A training task's result depends only on its dispatched weights, its client's data, its client's
objective state and its seed, so it may be computed at any moment before its completion event.
With ``cohort_size`` 1 a task trains when it completes (cancelled work costs nothing). With a
cohort, the first completion that finds its task untrained trains it together with the other
running training tasks (soonest completion first, up to the cohort size) in one vectorised pass
(:mod:`felix.client.cohort`); each result waits for its own completion event. Only a device's
current task is trained early, so all its earlier tasks are finished and its state is final; the
new state is committed at completion, and a cancelled task's result is dropped unseen, so
cancellation changes nothing. A device whose data changes (augmentation) before completion is
retrained.
"""
from __future__ import annotations

import heapq
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
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
    NewModelVersion,
    UpdateRejected,
)
from felix.core.events import ClientRegistered, Event, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import Knowledge, Orchestrator
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.metrics.recorder import HEADER_BYTES, Recorder
from felix.scenario.traces import DeviceTrace

log = logging.getLogger("felix.sim")

_TIER, _DONE, _WAKE = 0, 1, 2


@dataclass
class SimTask:
    task_id: int
    kind: TaskKind
    weights: np.ndarray
    aux: dict[str, np.ndarray]
    duration: float


@dataclass
class SimDevice:
    cid: int
    data: ClientData
    runtime_s: float
    trace: DeviceTrace
    tier: Tier
    state: dict = field(default_factory=dict)  # objective state kept between the client's tasks
    queue: deque[SimTask] = field(default_factory=deque)
    current: SimTask | None = None
    started_at: float | None = None  # None while paused
    remaining: float = 0.0
    token: int = 0  # invalidates a completion scheduled before a pause or cancel
    augmented: bool = False  # the client applied its data-plan row (once, on the first task bringing it)

    def can_run(self, kind: TaskKind) -> bool:
        return self.tier is Tier.AVL_TRAIN or (kind is TaskKind.EVAL and self.tier is Tier.AVL_EVAL)


class CohortExecutor(Protocol):
    """Where a cohort's tasks train (``run.executor``): in this process (:class:`~felix.client.cohort.CohortTrainer`) or on
    Ray actors (:class:`felix.distributed.cohort_executor.RayCohortExecutor`). ``train`` returns one
    update per task, in order, and writes each client's new objective state into its task."""

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]: ...

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[ClientUpdate]: ...


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class SimSettings:
    seed: int = 0
    max_time_s: float = 86400.0
    max_aggregations: int | None = None
    stop_at_target: bool = True
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


class Simulation:
    def __init__(self, orch: Orchestrator, devices: list[SimDevice], trainer: LocalTrainer,
                 recorder: Recorder, settings: SimSettings,
                 on_train: Callable[[SimDevice, SimTask], None] | None = None,
                 augment: Callable[[SimDevice, tuple[int, ...]], float] | None = None,
                 cohort: CohortExecutor | None = None) -> None:
        self.orch = orch
        self.devices = devices
        self.trainer = trainer
        self.cohort = cohort if settings.cohort_size > 1 else None
        self._trained: dict[int, _Trained] = {}  # by task id
        self._unused = 0
        self._probed: dict[int, _Trained] = {}
        self.rec = recorder
        self.cfg = settings
        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._wake_at: float | None = None
        self._stop: str | None = None
        self._rejected: list[UpdateRejected] = []
        self._train_seconds = 0.0
        self._on_train = on_train
        self._augment = augment  # applies a data-plan row to a device, returns its virtual seconds
        self._shown = -1
        self._model_bytes = 4 * int(orch.weights.size) + HEADER_BYTES
        self._tiers_cost = orch.cfg.knowledge is Knowledge.TIERTRACK

    # ------------------------------------------------------------------ heap
    def _push(self, t: float, kind: int, cid: int = -1, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, cid, token))

    def _deliver(self, event: Event) -> None:
        self._apply(self.orch.handle(event))
        wake = self.orch.next_wakeup()
        if wake is not None and (self._wake_at is None or wake < self._wake_at or self._wake_at <= self.now):
            self._wake_at = max(wake, self.now)
            self._push(self._wake_at, _WAKE)

    # ------------------------------------------------------------------ run
    def run(self) -> SimOutcome:
        wall0 = time.perf_counter()
        self.rec.record(0.0, 0, self.orch.weights)
        for dev in self.devices:
            counts = tuple(int(c) for c in torch.bincount(dev.data.y, minlength=self.trainer.num_classes))
            self.rec.bytes.add("up", "control", HEADER_BYTES + 8 * len(counts))
            self._deliver(ClientRegistered(0.0, dev.cid, len(dev.data), dev.tier, counts))
            self._schedule_tier(dev)
        try:
            self._loop()
        finally:
            if isinstance(self.cohort, _Closable):  # remote executors end their workers with the run
                self.cohort.close()
        if self._stop is None:
            self._stop = "no_more_events"
        last = self.rec.rows[-1]
        if last.version != self.orch.version:
            self.rec.record(self.now, self.orch.version, self.orch.weights)
        if self.cfg.progress:
            sys.stderr.write("\n")
        return SimOutcome(self.now, time.perf_counter() - wall0, self._stop, self._rejected, self._train_seconds,
                          self._unused)

    def _loop(self) -> None:
        while self._heap and self._stop is None:
            t, _, kind, cid, token = heapq.heappop(self._heap)
            if t > self.cfg.max_time_s:
                self.now = self.cfg.max_time_s
                self._stop = "max_time"
                break
            self.now = t
            if kind == _TIER:
                self._on_tier(self.devices[cid])
            elif kind == _DONE:
                self._on_done(self.devices[cid], token)
            elif t == self._wake_at:
                self._wake_at = None
                self._deliver(Tick(t))
            self._progress()

    def _progress(self) -> None:
        if self.cfg.progress and self.rec.rows and self.orch.version != self._shown:
            self._shown = self.orch.version
            r = self.rec.rows[-1]
            end = "\r" if sys.stderr.isatty() else "\n"
            if end == "\r" or self._shown % 50 == 0:
                sys.stderr.write(f"  t={self.now:9.0f}s  version={self._shown:5d}  accuracy={r.accuracy:.4f}{end}")

    # ------------------------------------------------------------------ devices
    def _schedule_tier(self, dev: SimDevice) -> None:
        nxt = dev.trace.next_change(self.now)
        if nxt is not None and nxt[0] <= self.cfg.max_time_s:
            self._push(nxt[0], _TIER, dev.cid)

    def _on_tier(self, dev: SimDevice) -> None:
        new = dev.trace.tier_at(self.now)
        self._schedule_tier(dev)
        if new is dev.tier:
            return
        dev.tier = new
        task = dev.current
        if task is not None:
            if dev.started_at is not None and not dev.can_run(task.kind):
                dev.remaining -= self.now - dev.started_at
                dev.started_at = None
                dev.token += 1
            elif dev.started_at is None and dev.can_run(task.kind):
                self._resume(dev)
        else:
            self._try_start(dev)
        if self._tiers_cost:
            self.rec.bytes.add("up", "control", HEADER_BYTES)
        self._deliver(TierChanged(self.now, dev.cid, new))

    def _resume(self, dev: SimDevice) -> None:
        dev.started_at = self.now
        dev.token += 1
        self._push(self.now + dev.remaining, _DONE, dev.cid, dev.token)

    def _try_start(self, dev: SimDevice) -> None:
        if dev.current is None and dev.queue and dev.can_run(dev.queue[0].kind):
            dev.current = dev.queue.popleft()
            dev.remaining = dev.current.duration
            self._resume(dev)

    def _on_done(self, dev: SimDevice, token: int) -> None:
        if token != dev.token or dev.current is None:
            return
        task, dev.current, dev.started_at = dev.current, None, None
        if task.kind is TaskKind.TRAIN:
            if self._on_train is not None:
                self._on_train(dev, task)
            t0 = time.perf_counter()
            done = self._trained.pop(task.task_id, None)
            if done is not None and done.data is not dev.data:
                done, self._unused = None, self._unused + 1
            if done is None and self.cohort is not None:
                done = self._train_cohort(dev, task)
            if done is None:
                upd = self.trainer.train(task.weights, dev.data, dev.state, task.aux, self._generator(task))
            else:
                upd = done.update
                dev.state.clear()
                dev.state.update(done.state)
            self._train_seconds += time.perf_counter() - t0
            self.rec.bytes.add("up", "train", self._model_bytes + aux_nbytes(upd.aux))
        else:
            probed = self._probed.pop(task.task_id, None)
            if probed is None or probed.data is not dev.data:
                probed = self._probe_cohort(dev, task) if self.cohort is not None else None
            upd = probed.update if probed is not None else self.trainer.probe(task.weights, dev.data)
            self.rec.bytes.add("up", "eval", HEADER_BYTES + 16)
        upd.duration = task.duration
        self._try_start(dev)
        self._deliver(TaskFinished(self.now, dev.cid, task.task_id, upd))

    def _generator(self, task: SimTask) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + task.task_id)

    def _ready(self, dev: SimDevice, task: SimTask, done: dict) -> list[tuple[SimDevice, SimTask]]:
        """``(dev, task)`` and the other devices' running tasks of the same kind that have no result
        yet, soonest completion first, up to the cohort size; paused tasks wait (they are the
        likeliest to time out)."""
        others = [(d, d.current) for d in self.devices
                  if d is not dev and d.current is not None and d.started_at is not None
                  and d.current.kind is task.kind and d.current.task_id not in done]
        others.sort(key=lambda p: (p[0].started_at + p[0].remaining, p[0].cid))  # type: ignore[operator]
        return [(dev, task)] + others[: self.cfg.cohort_size - 1]  # type: ignore[list-item]

    def _train_cohort(self, dev: SimDevice, task: SimTask) -> _Trained | None:
        """Train ``task`` (``dev``'s, just completed) with the other ready tasks; None when too few
        are ready for a vectorised pass to pay."""
        assert self.cohort is not None
        group = self._ready(dev, task, self._trained)
        if len(group) < self.cfg.min_cohort:
            return None
        cohort = [CohortTask(t.weights, d.data, dict(d.state), t.aux, self._generator(t)) for d, t in group]
        updates = self.cohort.train(cohort)
        for (d, t), c, u in zip(group[1:], cohort[1:], updates[1:]):
            self._trained[t.task_id] = _Trained(u, c.state, d.data)
        return _Trained(updates[0], cohort[0].state, dev.data)

    def _probe_cohort(self, dev: SimDevice, task: SimTask) -> _Trained | None:
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
            if isinstance(cmd, DispatchTrain):
                dev = self.devices[cmd.client_id]
                self.rec.bytes.add("down", "train", self._model_bytes + aux_nbytes(cmd.aux) + 8 * len(cmd.plan))
                augment_s = 0.0
                if cmd.plan and not dev.augmented and self._augment is not None:
                    dev.augmented = True  # augmentation (and its time) belongs to the first task with the row
                    augment_s = self._augment(dev, cmd.plan)
                # The server's aux dict changes at every aggregation: the task keeps what it was sent.
                dev.queue.append(SimTask(cmd.task_id, TaskKind.TRAIN, cmd.weights, dict(cmd.aux),
                                         augment_s + dev.runtime_s))
                self._try_start(dev)
            elif isinstance(cmd, DispatchEval):
                dev = self.devices[cmd.client_id]
                self.rec.bytes.add("down", "eval", self._model_bytes)
                dev.queue.append(SimTask(cmd.task_id, TaskKind.EVAL, cmd.weights, {},
                                         dev.runtime_s * self.cfg.eval_fraction))
                self._try_start(dev)
            elif isinstance(cmd, CancelTask):
                self._cancel(self.devices[cmd.client_id], cmd.task_id)
            elif isinstance(cmd, NewModelVersion):
                self._on_version(cmd)
            elif isinstance(cmd, UpdateRejected):
                log.warning("rejected update from client %d task %d: %s", cmd.client_id, cmd.task_id, cmd.reason)
                self._rejected.append(cmd)

    def _cancel(self, dev: SimDevice, task_id: int) -> None:
        self.rec.bytes.add("down", "control", HEADER_BYTES)
        self._unused += self._trained.pop(task_id, None) is not None
        self._probed.pop(task_id, None)
        if dev.current is not None and dev.current.task_id == task_id:
            dev.current, dev.started_at = None, None
            dev.token += 1
            self._try_start(dev)
        else:
            dev.queue = deque(t for t in dev.queue if t.task_id != task_id)

    def _on_version(self, cmd: NewModelVersion) -> None:
        self.rec.on_aggregation(cmd)
        if self.rec.due(cmd.version):
            self.rec.record(self.now, cmd.version, cmd.weights)
            if self.cfg.stop_at_target and self.rec.reached:
                self._stop = "target_reached"
        if self.cfg.max_aggregations is not None and cmd.version >= self.cfg.max_aggregations:
            self._stop = self._stop or "max_aggregations"
        if self.rec.converged_at is not None:
            self._stop = self._stop or "converged"


def make_devices(datas: list[ClientData], runtimes: np.ndarray, trace_for: Callable[[int], DeviceTrace]) -> list[SimDevice]:
    return [SimDevice(k, d, float(runtimes[k]), trace_for(k), trace_for(k).tier_at(0.0)) for k, d in enumerate(datas)]


def aux_nbytes(aux: dict[str, np.ndarray]) -> int:
    return sum(np.asarray(v).nbytes for v in aux.values())
