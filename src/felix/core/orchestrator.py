"""The sans-I/O orchestrator: events in, commands out.

Both shells (the simulation engine and the MQTT deployment) drive this one class, so a strategy
behaves the same in both. It never reads a clock or touches I/O: time arrives inside events and
``next_wakeup()`` tells the shell when to deliver a ``Tick`` for timers to fire.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

import numpy as np

from felix.core.admission import Admission, AdmissionConfig
from felix.core.availability import AVAILABILITY, AvailabilityPolicy
from felix.core.client_map import ClientMap, ClientRecord
from felix.core.commands import (
    AggregationReport,
    CancelTask,
    Command,
    DispatchEval,
    DispatchTrain,
    NewModelVersion,
    UpdateRejected,
)
from felix.core.dataplan import DataPlanPolicy
from felix.core.events import ClientRegistered, Event, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.policies import (
    Aggregator,
    AvailabilityOracle,
    EvalSelector,
    SelectionContext,
    TrainSelector,
)
from felix.core.rounds import ROUND_POLICIES, RoundPolicy
from felix.core.types import BufferedUpdate, ClientUpdate, Task, TaskKind, TaskState, Tier
from felix.core.validation import UpdateValidator, ValidationConfig

# Closed task ids are remembered one by one only above a watermark (the oldest task still open):
# below it every id not open is closed. Compaction runs when this many ids are remembered.
CLOSED_COMPACT_AT = 4096
_KINDS = (TaskKind.TRAIN, TaskKind.EVAL)
_STATES = tuple(TaskState)


class Knowledge(str, Enum):
    """The built-in availability policies' names (``felix.core.availability`` has their behaviour);
    ``OrchestratorConfig.knowledge`` also takes the name of any other registered policy."""

    NONE = "none"
    ORACLE = "oracle"
    TIERTRACK = "tiertrack"


@dataclass(frozen=True, slots=True)
class OrchestratorConfig:
    """The round policy (``mode``) and availability policy (``knowledge``) are registered names
    (``felix.core.rounds.ROUND_POLICIES``, ``felix.core.availability.AVAILABILITY``), with their own
    parameters in ``mode_params`` / ``knowledge_params``; the fields between are the settings the
    built-in round policies share."""

    mode: str = "async"  # "sync" rounds or "async" buffered, or another registered round policy
    agg_goal: int = 10
    concurrency: int = 30  # async: training tasks kept in flight
    overcommit: float = 1.3  # sync: clients selected per round = ceil(agg_goal * overcommit)
    deadline_s: float | None = None  # sync: end the round with what has arrived
    cancel_stragglers: bool = True  # sync: cancel a round's outstanding tasks when it ends
    task_timeout_s: float | None = 90.0
    accept_late: bool = True  # aggregate replies of timed-out / interrupted tasks (stale)
    max_staleness: int | None = None  # discard updates staler than this (versions)
    # Keep only each client's oldest task that lost its slot (newer ones are cancelled): open tasks
    # bounded by the population. The MQTT server always sets it; off by default in the simulator,
    # where every late reply may still come, as on the FeLiX authors' server.
    one_late_task_per_client: bool = False
    # An eval task's utility is a full forward pass on the received model; a training task's is
    # measured during SGD, so it is lower. This factor puts eval utilities on the training scale
    # (1.0: as measured, the paper), so Oort does not favour clients merely for having been probed.
    eval_utility_scale: float = 1.0
    # An eval task that times out while its client still owes the reply of an older task (one that
    # lost its slot, e.g. a training task paused when the client went AVL_EVAL) waits behind it:
    # the device runs its tasks in order. With this set, that timeout does not tell the
    # availability policy (TierTrack would mark the client UN_AVL): the client is busy, not gone.
    spare_queued_evals: bool = False
    # False: clients that still owe an older task's reply are not probed (their eval would wait
    # behind that task, its model download wasted on a stale measurement). True: the paper.
    probe_busy_clients: bool = True
    knowledge: Knowledge | str = Knowledge.NONE
    mode_params: Any = None  # the round policy's parameters (a mapping or its pydantic model)
    knowledge_params: Any = None  # the availability policy's parameters
    # Per-client flap damping and task budget (felix.core.admission); the defaults never bind on
    # the shipped scenarios' honest clients.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        ROUND_POLICIES.entry(
            self.mode
        )  # a registered name or import path, else a RegistryError naming the key
        if self.knowledge in set(Knowledge):
            object.__setattr__(self, "knowledge", Knowledge(self.knowledge))
        else:
            AVAILABILITY.entry(str(self.knowledge))
        if self.agg_goal < 1:
            raise ValueError("agg_goal must be at least 1")
        if self.overcommit < 1.0:
            raise ValueError("overcommit must be >= 1.0")
        for name in ("deadline_s", "task_timeout_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or null")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or null")
        if not self.eval_utility_scale > 0:
            raise ValueError("eval_utility_scale must be > 0")


@dataclass(slots=True)
class OrchestratorStats:
    """Counters and per-event diagnostics the metrics layer turns into a report."""

    train_dispatched: int = 0
    eval_dispatched: int = 0
    evals_done: int = 0
    updates_applied: int = 0
    updates_discarded: int = 0  # accepted messages not aggregated: too stale, or late after cancel
    rejected: int = 0  # malformed / forged / replayed messages
    updates_clipped: int = 0  # accepted after scaling down to the validator's norm bound
    train_dropped: int = 0  # training tasks that lost their slot mid-task (interrupt or timeout)
    train_cancelled: int = 0
    rounds_started: int = 0
    aggregation_times: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    agg_weights: list[float] = field(default_factory=list)
    utility_age_at_selection: list[int] = field(default_factory=list)
    never_explored_at_selection: int = 0


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        initial_weights: np.ndarray,
        selector: TrainSelector,
        aggregator: Aggregator,
        rng: np.random.Generator,
        eval_selector: EvalSelector | None = None,
        oracle: AvailabilityOracle | None = None,
        validator: UpdateValidator | None = None,
        data_plan: DataPlanPolicy | None = None,
        round_policy: RoundPolicy | None = None,
        availability: AvailabilityPolicy | None = None,
    ) -> None:
        """The round and availability policies default to those the config names, with
        ``mode_params`` / ``knowledge_params``; pass objects to use others."""
        if initial_weights.ndim != 1:
            raise ValueError("initial_weights must be a flat parameter vector")
        self.cfg = config
        self.selector = selector
        self.aggregator = aggregator
        self.eval_selector = eval_selector or EvalSelector()
        self.rng = rng
        self.oracle = oracle
        self.rounds = round_policy or ROUND_POLICIES.create(config.mode, config.mode_params, config)
        knowledge = config.knowledge.value if isinstance(config.knowledge, Knowledge) else config.knowledge
        self.availability = availability or AVAILABILITY.create(knowledge, config.knowledge_params, config)
        self.data_plan = data_plan or DataPlanPolicy()
        # Without one from the shell (``build_orchestrator`` makes it from the config, norms included),
        # samples are bounded and no aux entry is admitted; the norm bound needs the clients' local
        # schedule, which only the config knows, so a bare orchestrator leaves it off.
        self.validator = (
            validator if validator is not None else UpdateValidator(ValidationConfig(norm_policy="off"))
        )
        self.clients = ClientMap()
        self.admission = Admission(config.admission)
        self.stats = OrchestratorStats()
        self.version = 0
        self.round = 0  # sync: rounds started; async: equals the version
        self.now = 0.0
        self.aux: dict[str, np.ndarray] = {}
        self.plans: dict[int, tuple[int, ...]] = {}
        self._theta = _frozen(initial_weights.astype(np.float32, copy=True))
        self._tasks: dict[int, Task] = {}
        self._closed: dict[
            int, TaskState
        ] = {}  # task id -> DONE / CANCELLED, for replays, above the watermark
        self._closed_below = 1  # every task id below it is open (in _tasks) or closed
        self._next_task = 1
        self._timers: list[tuple[float, int]] = []
        self._buffer: list[BufferedUpdate] = []
        self._held: list[int] = []  # training tasks assigned while the data plan is pending, not yet sent
        self._evals_this_round = 0
        self._probe_dropped: set[int] = (
            set()
        )  # clients whose eval task dropped this round: not probed again in it
        self._train_in_flight = 0
        self._late: dict[int, int] = {}  # client -> its task that lost its slot and may still answer late
        self._expired: list[Task] = []  # such tasks closed since the last event: their cancels go out with it
        self._rejoin_at: float | None = None  # when blocked clients may train again (the stall rule)
        self._stat_arrays: dict[str, np.ndarray] = {}  # state_dict's converted statistics lists
        # The model's path: cumulative relative movement (sum over aggregations of the step's norm
        # over the new model's norm) when each round began, for eval selectors that skip probes
        # when the model has barely moved since a client's utility was measured.
        self._path = np.zeros(64, dtype=np.float64)
        self._path_total = 0.0

    # ------------------------------------------------------------------ public API
    @property
    def weights(self) -> np.ndarray:
        return self._theta

    def tasks(self) -> list[Task]:
        return list(self._tasks.values())

    def set_data_plan(self, plans: dict[int, tuple[int, ...]]) -> None:
        """Attach each client's row of a data plan (DAFL / LB); it travels with each of its training
        tasks (a client augments once, on the first) so that a client that restarts still gets it."""
        self.plans = dict(plans)

    def next_wakeup(self) -> float | None:
        while self._timers:
            task_id = self._timers[0][1]
            task = self._tasks.get(task_id)
            if task is not None and task.holds_slot:
                break
            heapq.heappop(self._timers)
        times = [self._timers[0][0]] if self._timers else []
        deadline = self.rounds.wakeup()
        if deadline is not None:
            times.append(deadline)
        if self._rejoin_at is not None and self._rejoin_at > self.now:  # one due now is taken by _fill
            times.append(self._rejoin_at)
        admit = self.admission.next_wakeup()
        if admit is not None:
            times.append(admit)
        return min(times) if times else None

    def handle(self, event: Event) -> list[Command]:
        if event.time < self.now:
            raise ValueError(f"event time {event.time} is before the orchestrator's time {self.now}")
        self.now = float(event.time)
        out: list[Command] = []
        if isinstance(event, ClientRegistered):
            self._on_registered(event, out)
        elif isinstance(event, TierChanged):
            self._on_tier(event, out)
        elif isinstance(event, TaskFinished):
            self._on_finished(event, out)
        elif isinstance(event, TaskFailed):
            self._on_failed(event, out)
        elif not isinstance(event, Tick):
            raise TypeError(f"not an orchestrator event: {event!r}")
        self._admit_due()
        self._fire_timers(out)
        self._fill(out)
        for task in self._expired:
            self.admission.charge(task.client_id, self.now)
            out.append(
                CancelTask(task.task_id, task.client_id, "lost its slot behind an older one still open")
            )
        self._expired.clear()
        return out

    def _admit_due(self) -> None:
        """Damped clients whose hold has passed act on their last reported tier again; clients
        whose task budget has refilled may be selected again."""
        if self.admission.next_wakeup() is None:
            return
        for cid in self.admission.due(self.now):
            if cid in self.clients:
                rec = self.clients[cid]
                self.availability.on_tier(self, rec, rec.reported_tier)

    # ------------------------------------------------------------------ events
    def _on_registered(self, ev: ClientRegistered, out: list[Command]) -> None:
        if ev.client_id in self.clients:
            self._reject(ev.client_id, 0, "client registered twice", out)
            return
        if ev.num_samples < 0:
            self._reject(ev.client_id, 0, "negative sample count at registration", out)
            return
        if not (-(2**63) <= ev.client_id < 2**63 and ev.num_samples < 2**63):  # the ClientMap's int64 columns
            self._reject(ev.client_id, 0, "client id or sample count beyond 64 bits at registration", out)
            return
        self.clients.add(
            ClientRecord(
                client_id=ev.client_id,
                num_samples=ev.num_samples,
                tier=self.availability.registered_tier(ev.tier),
                reported_tier=ev.tier,
                class_counts=tuple(ev.class_counts),
            )
        )
        rows = self.data_plan.on_registered(self.clients, self.now)
        if rows is not None:
            self.plans = dict(rows)
            self._send_held(out)

    def _on_tier(self, ev: TierChanged, out: list[Command]) -> None:
        if ev.client_id not in self.clients:
            self._reject(ev.client_id, 0, "tier change from an unknown client", out)
            return
        rec = self.clients[ev.client_id]
        damped = self.admission.is_damped(ev.client_id)
        if ev.tier is not rec.reported_tier:
            flapping = self.admission.tier_changed(ev.client_id, self.now)
            if flapping and not damped:  # it starts flapping now: it is treated as unavailable
                self.availability.on_tier(self, rec, Tier.UN_AVL)
            damped = flapping
        rec.reported_tier = ev.tier
        if not damped:  # a damped client's reports are kept, and acted on when its hold ends
            self.availability.on_tier(self, rec, ev.tier)

    def _on_finished(self, ev: TaskFinished, out: list[Command]) -> None:
        valid = self._validate(ev, out)
        if valid is None:
            return
        task, upd = valid
        rec = self.clients[task.client_id]
        late = task.state is not TaskState.IN_FLIGHT
        if task.holds_slot:
            self._free_slot(task)
        self._tasks.pop(task.task_id)
        self._close(task.task_id, TaskState.DONE)
        self.availability.on_reply(self, rec)
        scale = self.cfg.eval_utility_scale if task.kind is TaskKind.EVAL else 1.0
        rec.stat_utility = float(upd.stat_utility) * scale
        rec.last_utility_round = self.round
        ctx = self._ctx()
        if task.kind is TaskKind.EVAL:
            rec.times_evaluated += 1
            self.stats.evals_done += 1
            self.selector.on_update(rec, ctx)
            return
        rec.last_duration = float(upd.duration)
        self.selector.on_update(rec, ctx)
        if late and not self.cfg.accept_late:
            self.stats.updates_discarded += 1
            return
        staleness = self.version - task.base_version
        if self.cfg.max_staleness is not None and staleness > self.cfg.max_staleness:
            self.stats.updates_discarded += 1
            return
        rec.times_updated += 1
        self._buffer.append(
            BufferedUpdate(rec.client_id, task.task_id, task.base_version, self.now, upd, staleness)
        )
        self.rounds.on_buffered(self, task, out)

    def _on_failed(self, ev: TaskFailed, out: list[Command]) -> None:
        task = self._tasks.get(ev.task_id)
        if task is None or task.client_id != ev.client_id:
            self._reject(
                ev.client_id, ev.task_id, f"failure report for a task it does not hold ({ev.reason})", out
            )
            return
        if task.holds_slot:  # a task that lost its slot earlier was counted as dropped then
            self._free_slot(task)
            if task.kind is TaskKind.TRAIN:
                self.stats.train_dropped += 1
                self.clients[task.client_id].times_dropped += 1
                self.clients[task.client_id].blocked_round = task.round
            else:
                self._probe_dropped.add(task.client_id)
        self._tasks.pop(task.task_id)
        self._close(task.task_id, TaskState.CANCELLED)

    # ------------------------------------------------------------------ validation
    def _validate(self, ev: TaskFinished, out: list[Command]) -> tuple[Task, ClientUpdate] | None:
        if ev.client_id not in self.clients:
            self._reject(ev.client_id, ev.task_id, "unknown client", out)
            return None
        task = self._tasks.get(ev.task_id)
        if task is None:
            closed = self._closed.get(ev.task_id)
            unknown = (
                "result for a closed task"
                if 0 < ev.task_id < self._closed_below
                else "result for a task the server never assigned"
            )
            reason = {
                TaskState.DONE: "replayed result: task already applied",
                TaskState.CANCELLED: "result for a cancelled task",
            }.get(closed, unknown)  # type: ignore[arg-type]
            self._reject(ev.client_id, ev.task_id, reason, out)
            return None
        if task.client_id != ev.client_id:
            self._reject(ev.client_id, ev.task_id, f"task {ev.task_id} was assigned to another client", out)
            return None
        upd = ev.update
        if not (math.isfinite(upd.stat_utility) and math.isfinite(upd.loss) and math.isfinite(upd.duration)):
            self._reject(ev.client_id, ev.task_id, "non-finite loss, utility or duration", out)
            return None
        if upd.num_samples <= 0 and task.kind is TaskKind.TRAIN:
            self._reject(ev.client_id, ev.task_id, "training update over no samples", out)
            return None
        if task.kind is TaskKind.TRAIN:
            d = upd.delta
            if d is None:
                self._reject(ev.client_id, ev.task_id, "training result without a model update", out)
                return None
            if d.shape != self._theta.shape or d.dtype != np.float32:
                self._reject(
                    ev.client_id,
                    ev.task_id,
                    f"model update of shape {d.shape}/{d.dtype}, expected {self._theta.shape}/float32",
                    out,
                )
                return None
            if not np.isfinite(d).all():
                self._reject(ev.client_id, ev.task_id, "model update holds non-finite values", out)
                return None
            for key, val in upd.aux.items():
                if not np.isfinite(np.asarray(val, dtype=np.float64)).all():
                    self._reject(ev.client_id, ev.task_id, f"aux {key!r} holds non-finite values", out)
                    return None
            span = upd.data_span
            # (Not checked against the server's clock: a deployed client's clock is its own.)
            if span is not None and not (
                len(span) == 2 and all(math.isfinite(v) for v in span) and span[0] <= span[1]
            ):
                self._reject(ev.client_id, ev.task_id, "data span not finite or reversed", out)
                return None
        rec = self.clients[ev.client_id]
        verdict = self.validator.check(
            ev.client_id, task.kind, upd, rec.num_samples, sum(self.plans.get(ev.client_id, ())), self._theta
        )
        if verdict.update is None:
            self._reject(ev.client_id, ev.task_id, verdict.reason, out)
            return None
        if verdict.clipped:
            self.stats.updates_clipped += 1
        return task, verdict.update

    def _reject(self, client_id: int, task_id: int, reason: str, out: list[Command]) -> None:
        self.stats.rejected += 1
        out.append(UpdateRejected(self.now, client_id, task_id, reason))

    def _close(self, task_id: int, state: TaskState) -> None:
        """Remember a closed task; past ``CLOSED_COMPACT_AT`` ids, raise the watermark to the oldest
        open task and forget the ids below it (they stay closed: not open and below the mark)."""
        self._closed[task_id] = state
        if len(self._closed) < CLOSED_COMPACT_AT:
            return
        # Tasks that lost their slot stay open below the mark (they are looked up in ``_tasks``
        # first), so a client that never answers does not pin the mark and grow ``_closed``.
        mark = min((t for t, task in self._tasks.items() if task.holds_slot), default=self._next_task)
        if mark > self._closed_below:
            self._closed_below = mark
            self._closed = {t: s for t, s in self._closed.items() if t >= mark}

    # ------------------------------------------------------------------ slots and timers
    def _free_slot(self, task: Task) -> None:
        self.clients.set_in_flight(task.client_id, None)
        if task.kind is TaskKind.TRAIN:
            self._train_in_flight -= 1

    def _release(self, task: Task, state: TaskState) -> None:
        """A task loses its slot mid-way; its late reply may still come (and be accepted).

        With ``one_late_task_per_client`` each client keeps at most one such task open, so open
        tasks are bounded by the population, not the run's history: when the client already has
        one, this newer task is closed (and cancelled with the event's commands). A device runs its tasks in order, so the newer one
        has not started (the older holds the progress); a device that restarted has its old task
        failed by the shell (``late_task``), so it never blocks the newer ones.
        """
        self._free_slot(task)
        task.state = state
        old = self._late.get(task.client_id)
        prev = None if old is None or old == task.task_id else self._tasks.get(old)
        if (
            self.cfg.one_late_task_per_client
            and self.cfg.accept_late
            and prev is not None
            and not prev.holds_slot
        ):
            self._tasks.pop(task.task_id)
            self._close(task.task_id, TaskState.CANCELLED)
            self._expired.append(task)
        else:
            self._late[task.client_id] = task.task_id
        rec = self.clients[task.client_id]
        if task.kind is TaskKind.TRAIN:
            self.stats.train_dropped += 1
            rec.times_dropped += 1
            rec.blocked_round = task.round
        else:
            # The eval path's rejoin rule: a client that leaves (or times out, or fails) mid-probe
            # is not probed again this round, or each tier flip would cost a full model download.
            self._probe_dropped.add(task.client_id)

    def _fire_timers(self, out: list[Command]) -> None:
        while self._timers and self._timers[0][0] <= self.now:
            _, task_id = heapq.heappop(self._timers)
            task = self._tasks.get(task_id)
            if task is None or not task.holds_slot:
                continue
            queued = task.kind is TaskKind.EVAL and self.late_task(task.client_id) is not None
            self._release(task, TaskState.TIMED_OUT)
            if not (queued and self.cfg.spare_queued_evals):
                self.availability.on_timeout(self, task)
            if not self.cfg.accept_late:
                self._cancel(task, "timed out", out)
        self.rounds.on_timers(self, out)

    def _compact_timers(self) -> None:
        """Drop the timers of tasks that no longer hold a slot (they would fire as no-ops), so the
        heap holds about one entry per open task instead of one per task of the last timeout."""
        live = [
            (t, i) for t, i in self._timers if (task := self._tasks.get(i)) is not None and task.holds_slot
        ]
        heapq.heapify(live)
        self._timers = live

    def _cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        if task.holds_slot:
            self._free_slot(task)
        self._tasks.pop(task.task_id, None)
        self._close(task.task_id, TaskState.CANCELLED)
        if task.kind is TaskKind.TRAIN:
            self.stats.train_cancelled += 1
        self.admission.charge(task.client_id, self.now)
        out.append(CancelTask(task.task_id, task.client_id, reason))

    # ------------------------------------------------------------------ selection
    def _ctx(self) -> SelectionContext:
        return SelectionContext(
            self.now, self.round, self.clients, self.rng, self.oracle, self._path[: self.round + 1]
        )

    def _train_candidates(self) -> np.ndarray:
        """Idle clients that may train now (ids, in id order), from the ClientMap's columns.

        The rejoin rule: a client that dropped its task this round is not picked again in it; in
        sync mode nobody trains twice in one round. One vectorised filter over the idle set.

        The stall rule: when no training task holds a slot and the rejoin rule leaves nobody to pick,
        no reply, timer or new version could ever lift it (async rounds follow the version), so the
        blocked clients may train again ``task_timeout_s`` later (at once without a timeout); until
        then ``next_wakeup`` returns that time.
        """
        m = self.clients
        rows = self.availability.train_rows(m, self.now)
        if self.admission.any_excluded and len(rows):
            rows = rows[~np.isin(m.ids_of(rows), self.admission.excluded_ids())]
        fresh = np.ones(len(rows), dtype=bool)
        if self.rounds.one_task_per_round:
            fresh = m.column("selected_round")[rows] != self.round
        keep = fresh & (m.column("blocked_round")[rows] != self.round)
        if keep.all():  # the usual case: nobody to leave out, no copy
            self._rejoin_at = None
            return m.ids_of(rows)
        if keep.any() or self._train_in_flight > 0 or not fresh.any():
            self._rejoin_at = None
            return m.ids_of(rows[keep])
        if self._rejoin_at is None:
            self._rejoin_at = self.now + (self.cfg.task_timeout_s or 0.0)
        if self.now < self._rejoin_at:
            return m.ids_of(rows[keep])
        self._rejoin_at = None
        return m.ids_of(rows[fresh])

    def _fill(self, out: list[Command]) -> None:
        need = self.rounds.need(self)
        if need > 0:
            candidates = self._train_candidates()
            if len(candidates):
                picked = self.selector.select(candidates, min(need, len(candidates)), self._ctx())
                for cid in picked:
                    self._dispatch(cid, TaskKind.TRAIN, out)
        budget = self.eval_selector.per_round_budget - self._evals_this_round
        if budget > 0:
            cands = self.clients.idle_in(Tier.AVL_TRAIN, Tier.AVL_EVAL)
            if self._probe_dropped:
                cands = cands[~np.isin(cands, np.fromiter(self._probe_dropped, dtype=np.int64))]
            if not self.cfg.probe_busy_clients and len(cands):
                cands = cands[~np.isin(cands, self._owing())]
            if self.admission.any_excluded and len(cands):
                cands = cands[~np.isin(cands, self.admission.excluded_ids())]
            if len(cands):
                for cid in self.eval_selector.select(cands, budget, self._ctx()):
                    self._dispatch(cid, TaskKind.EVAL, out)

    def _dispatch(self, cid: int, kind: TaskKind, out: list[Command]) -> None:
        rec = self.clients[cid]
        if rec.in_flight is not None:
            raise RuntimeError(f"selector picked client {cid}, which already holds task {rec.in_flight}")
        task = Task(self._next_task, cid, kind, self.version, self.round, self.now)
        self._next_task += 1
        self.admission.charge(cid, self.now)
        self._tasks[task.task_id] = task
        self.clients.set_in_flight(cid, task.task_id)
        held = kind is TaskKind.TRAIN and self.data_plan.pending
        if not held:
            self._start_timer(task)
        if kind is TaskKind.TRAIN:
            self._train_in_flight += 1
            self.stats.train_dispatched += 1
            rec.selected_round = self.round
            rec.times_selected += 1
            if rec.explored:
                self.stats.utility_age_at_selection.append(self.round - rec.last_utility_round)
            else:
                self.stats.never_explored_at_selection += 1
            if held:
                self._held.append(task.task_id)
            else:
                out.append(
                    DispatchTrain(
                        task.task_id, cid, self.version, self._theta, self.aux, self.plans.get(cid, ())
                    )
                )
        else:
            self._evals_this_round += 1
            self.stats.eval_dispatched += 1
            out.append(DispatchEval(task.task_id, cid, self.version, self._theta))

    def _start_timer(self, task: Task) -> None:
        if self.cfg.task_timeout_s is not None:
            heapq.heappush(self._timers, (self.now + self.cfg.task_timeout_s, task.task_id))
            if len(self._timers) > 2 * len(self._tasks) + 64:
                self._compact_timers()

    def _send_held(self, out: list[Command]) -> None:
        """The data plan exists: send the training tasks held for it, in the order they were
        assigned, each with its row and the current model; their timeouts start now."""
        held, self._held = self._held, []
        for tid in held:
            task = self._tasks.get(tid)
            if task is None:
                continue
            if not task.holds_slot:  # it lost its slot while held (its client left): never sent, so closed
                self._tasks.pop(tid)
                self._close(tid, TaskState.CANCELLED)
                continue
            task.base_version = self.version
            self._start_timer(task)
            out.append(
                DispatchTrain(
                    tid,
                    task.client_id,
                    self.version,
                    self._theta,
                    self.aux,
                    self.plans.get(task.client_id, ()),
                )
            )

    # ------------------------------------------------------------------ the round and availability policies' API
    @property
    def buffered(self) -> int:
        """Updates waiting in the aggregation buffer."""
        return len(self._buffer)

    @property
    def train_in_flight(self) -> int:
        """Training tasks holding a slot."""
        return self._train_in_flight

    def late_task(self, client_id: int) -> int | None:
        """The id of the client's open task that lost its slot (awaiting a late reply), if any."""
        tid = self._late.get(client_id)
        task = None if tid is None else self._tasks.get(tid)
        return None if task is None or task.holds_slot else tid

    def _owing(self) -> np.ndarray:
        """Clients that still owe the reply of a task that lost its slot (their device runs it
        before any newer task)."""
        return np.fromiter((c for c in self._late if self.late_task(c) is not None), dtype=np.int64, count=-1)

    def task(self, task_id: int) -> Task:
        """An open task by id."""
        return self._tasks[task_id]

    def round_tasks(self, round_: int) -> list[Task]:
        """The open training tasks of round ``round_`` (a list: the caller may cancel them)."""
        return [t for t in self._tasks.values() if t.round == round_ and t.kind is TaskKind.TRAIN]

    def start_round(self, round_: int) -> None:
        """Number the round ``round_``; the eval-probe budget and the probe rejoin rule restart."""
        if round_ >= len(self._path):
            grown = np.zeros(max(2 * len(self._path), round_ + 1), dtype=np.float64)
            grown[: len(self._path)] = self._path
            self._path = grown
        self._path[self.round + 1 : round_ + 1] = self._path_total
        self.round = round_
        self._evals_this_round = 0
        self._probe_dropped.clear()

    def aggregate(self, out: list[Command]) -> None:
        """Apply the buffer now (a new model version), or reject what cannot be aggregated."""
        self._aggregate(out)

    def cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        """Withdraw ``task``: the client is told, and a late reply is rejected."""
        self._cancel(task, reason, out)

    def release(self, task: Task, state: TaskState) -> None:
        """``task`` loses its slot (it left or timed out); a late reply may still be accepted."""
        self._release(task, state)

    # ------------------------------------------------------------------ aggregation
    def _aggregate(self, out: list[Command]) -> None:
        for b in self._buffer:
            b.staleness = self.version - b.base_version
        try:
            theta, norm_w, aux = self._try_aggregate(self._buffer)
        except (ValueError, ArithmeticError) as exc:
            self._drop_unaggregatable(exc, out)
            return
        buffer, self._buffer = self._buffer, []
        new = theta.astype(np.float32, copy=False)
        norm = float(np.linalg.norm(new))
        if norm > 0:
            self._path_total += float(np.linalg.norm(new - self._theta)) / norm
        self._theta = _frozen(new)
        self.aux.update(aux)
        self.version += 1
        self.rounds.on_aggregated(self)
        st = self.stats
        st.updates_applied += len(buffer)
        st.aggregation_times.append(self.now)
        st.staleness.extend(b.staleness for b in buffer)
        st.agg_weights.extend(float(w) for w in norm_w)
        self.selector.on_round_end(self.round, self._ctx())
        report = AggregationReport(
            tuple(b.client_id for b in buffer),
            tuple(b.staleness for b in buffer),
            tuple(float(w) for w in norm_w),
            tuple(float(b.update.loss) for b in buffer),
            tuple(b.task_id for b in buffer),
            max((b.update.data_span[1] for b in buffer if b.update.data_span is not None), default=None),
        )
        out.append(NewModelVersion(self.version, self.now, self._theta, report))

    def _try_aggregate(
        self, buffer: list[BufferedUpdate]
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The aggregator's step, refused (ValueError) if it would leave the model non-finite."""
        theta, norm_w, aux = self.aggregator.aggregate(self._theta, buffer)
        if not np.isfinite(theta).all():
            raise ValueError("the aggregate holds non-finite values")
        return theta, norm_w, aux

    def _drop_unaggregatable(self, exc: Exception, out: list[Command]) -> None:
        """Aggregation failed: reject the updates that fail on their own, or else the newest one,
        and keep the rest buffered. Validation should make this unreachable; it is the backstop
        that keeps one bad update from wedging (or crashing) the run, with the model unchanged."""
        bad = []
        for b in self._buffer:
            try:
                self._try_aggregate([b])
            except (ValueError, ArithmeticError):
                bad.append(b)
        for b in bad or self._buffer[-1:]:
            self._buffer.remove(b)
            self._reject(b.client_id, b.task_id, f"update cannot be aggregated ({str(exc)[:120]})", out)

    # ------------------------------------------------------------------ checkpoints
    def reserve_task_ids(self, first: int) -> None:
        """Number the next tasks from ``first`` on (at least): a resumed server's fresh id range,
        so that a late result of a task dispatched after the checkpoint cannot match a new task."""
        self._next_task = max(self._next_task, int(first))

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed orchestrator needs, as plain values and numpy arrays.

        Explicit on purpose (no reflection over attributes): the config, the oracle and the
        policies' parameters are rebuilt from the config; the policies and the ClientMap give
        their own ``state_dict``. History is kept as arrays (closed task ids above a watermark,
        the per-update statistics), so saving costs array copies, not a Python object each.
        """
        tasks = list(self._tasks.values())
        n = len(tasks)
        st = self.stats
        return {
            "version": self.version,
            "round": self.round,
            "now": self.now,
            "theta": np.array(self._theta),
            "aux": {k: np.asarray(v) for k, v in self.aux.items()},
            "plans_ids": np.fromiter(self.plans.keys(), dtype=np.int64, count=len(self.plans)),
            "plans_len": np.fromiter(
                (len(r) for r in self.plans.values()), dtype=np.int64, count=len(self.plans)
            ),
            "plans_flat": np.fromiter((v for r in self.plans.values() for v in r), dtype=np.int64),
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
            "next_task": self._next_task,
            "timer_at": np.array([t for t, _ in self._timers], dtype=np.float64),
            "timer_task": np.array([i for _, i in self._timers], dtype=np.int64),
            "buffer": [
                {
                    "client_id": b.client_id,
                    "task_id": b.task_id,
                    "base_version": b.base_version,
                    "arrived_at": b.arrived_at,
                    "staleness": b.staleness,
                    "num_samples": b.update.num_samples,
                    "stat_utility": b.update.stat_utility,
                    "loss": b.update.loss,
                    "duration": b.update.duration,
                    "delta": None if b.update.delta is None else np.asarray(b.update.delta),
                    "aux": {k: np.asarray(v) for k, v in b.update.aux.items()},
                    "data_span": None if b.update.data_span is None else np.asarray(b.update.data_span),
                }
                for b in self._buffer
            ],
            "held": np.array(self._held, dtype=np.int64),
            "evals_this_round": self._evals_this_round,
            "probe_dropped": np.array(sorted(self._probe_dropped), dtype=np.int64),
            "model_path": np.array(self._path[: self.round + 1]),
            "model_path_total": self._path_total,
            "train_in_flight": self._train_in_flight,
            "rng": self.rng.bit_generator.state,
            "stats": {
                f.name: self._stat_array(f.name) if f.name in _LIST_STATS else getattr(st, f.name)
                for f in fields(st)
            },
            "clients": self.clients.state_dict(),
            "selector": self.selector.state_dict(),
            "eval_selector": self.eval_selector.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "validator": self.validator.state_dict(),
            "round_policy": self.rounds.state_dict(),
            "availability": self.availability.state_dict(),
            "data_plan": self.data_plan.state_dict(),
            "admission": self.admission.state_dict(),
        }

    def _stat_array(self, name: str) -> np.ndarray:
        """A per-update statistics list as an array, converting only what was appended since the
        last call (the lists only grow), so a checkpoint copies history instead of re-reading it."""
        values = getattr(self.stats, name)
        cached = self._stat_arrays.get(name)
        done = 0 if cached is None or len(cached) > len(values) else len(cached)
        tail = np.asarray(values[done:], dtype=np.float64 if name in _FLOAT_STATS else np.int64)
        arr = tail if done == 0 else np.concatenate([cached, tail])  # type: ignore[list-item]
        self._stat_arrays[name] = arr
        return arr

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output onto an orchestrator built from the same config."""
        self.version = int(state["version"])
        self.round = int(state["round"])
        self.now = float(state["now"])
        self._theta = _frozen(np.array(state["theta"], dtype=np.float32))
        self.aux = {k: np.asarray(v) for k, v in state["aux"].items()}
        flat = np.asarray(state["plans_flat"]).tolist()
        ends = np.cumsum(np.asarray(state["plans_len"], dtype=np.int64)).tolist()
        starts = [0, *ends[:-1]] if ends else []
        self.plans = {
            cid: tuple(flat[a:b])
            for cid, a, b in zip(np.asarray(state["plans_ids"]).tolist(), starts, ends, strict=True)
        }
        t = {k: np.asarray(v).tolist() for k, v in state["tasks"].items()}
        self._tasks = {}
        for i, tid in enumerate(t["task_id"]):
            self._tasks[tid] = Task(
                tid,
                t["client_id"][i],
                _KINDS[t["kind"][i]],
                t["base_version"][i],
                t["round"][i],
                t["dispatched_at"][i],
                _STATES[t["state"][i]],
            )
        self._late = {task.client_id: tid for tid, task in sorted(self._tasks.items()) if not task.holds_slot}
        self._expired = []
        self._rejoin_at = None
        self._closed = {
            tid: _STATES[s]
            for tid, s in zip(
                np.asarray(state["closed_ids"]).tolist(),
                np.asarray(state["closed_state"]).tolist(),
                strict=True,
            )
        }
        self._closed_below = int(state["closed_below"])
        self._next_task = int(state["next_task"])
        self._timers = list(
            zip(np.asarray(state["timer_at"]).tolist(), np.asarray(state["timer_task"]).tolist(), strict=True)
        )
        self._buffer = [
            BufferedUpdate(
                int(b["client_id"]),
                int(b["task_id"]),
                int(b["base_version"]),
                float(b["arrived_at"]),
                ClientUpdate(
                    int(b["num_samples"]),
                    float(b["stat_utility"]),
                    float(b["loss"]),
                    float(b["duration"]),
                    None if b["delta"] is None else np.array(b["delta"]),
                    {k: np.asarray(v) for k, v in b["aux"].items()},
                    _span(b.get("data_span")),
                ),
                int(b["staleness"]),
            )
            for b in state["buffer"]
        ]
        self._held = np.asarray(state["held"]).tolist()
        self._evals_this_round = int(state["evals_this_round"])
        self._probe_dropped = set(np.asarray(state["probe_dropped"]).tolist())
        # A checkpoint from before the model's path was kept restarts it at 0 (no movement known).
        path = np.asarray(state.get("model_path", np.zeros(self.round + 1)), dtype=np.float64)
        self._path = np.zeros(max(64, 2 * len(path)), dtype=np.float64)
        self._path[: len(path)] = path
        self._path_total = float(state.get("model_path_total", 0.0))
        self._train_in_flight = int(state["train_in_flight"])
        self.rng.bit_generator.state = state["rng"]
        saved = state["stats"]
        self._stat_arrays = {}
        for f in fields(self.stats):
            v = saved[f.name]
            setattr(self.stats, f.name, np.asarray(v).tolist() if f.name in _LIST_STATS else v)
        self.clients.load_state_dict(state["clients"])
        self.selector.load_state_dict(state["selector"])
        self.eval_selector.load_state_dict(state["eval_selector"])
        self.aggregator.load_state_dict(state["aggregator"])
        self.validator.load_state_dict(state["validator"])
        self.rounds.load_state_dict(state["round_policy"])
        self.availability.load_state_dict(state["availability"])
        self.data_plan.load_state_dict(state["data_plan"])
        if "admission" in state:  # checkpoints from before admission control start with fresh budgets
            self.admission.load_state_dict(state["admission"])


_LIST_STATS = frozenset({"aggregation_times", "staleness", "agg_weights", "utility_age_at_selection"})
_FLOAT_STATS = frozenset({"aggregation_times", "agg_weights"})


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _span(value: object) -> tuple[float, float] | None:
    """A checkpointed update's data span (absent from checkpoints written before streams)."""
    if value is None:
        return None
    a = np.asarray(value, dtype=np.float64)
    return float(a[0]), float(a[1])
