"""The sans-I/O orchestrator: events in, commands out.

Both shells (the simulation engine and the MQTT deployment) drive this one class, so a strategy
behaves the same in both. It never reads a clock or touches I/O: time arrives inside events and
``next_wakeup()`` tells the shell when to deliver a ``Tick`` for timers to fire.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from felix.core.admission import Admission
from felix.core.aggregation import Aggregator
from felix.core.availability import AVAILABILITY, AvailabilityPolicy
from felix.core.buffer import AggregationBuffer
from felix.core.client_map import ClientMap, ClientRecord
from felix.core.commands import (
    AggregationReport,
    CancelTask,
    Command,
    NewModelVersion,
    UpdateRejected,
)
from felix.core.dataplan import DataPlanPolicy
from felix.core.dispatch import Dispatch
from felix.core.eval_selection import EvalSelector
from felix.core.events import ClientRegistered, Event, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.ledger import TaskLedger
from felix.core.orchestrator_config import AvailabilityName, OrchestratorConfig
from felix.core.refusals import Refusal
from felix.core.rounds import ROUND_POLICIES, RoundPolicy
from felix.core.selection import AvailabilityOracle, TrainSelector
from felix.core.separation import Separation
from felix.core.stats import ModelPath, OrchestratorStats, StatsCheckpoint
from felix.core.types import BufferedUpdate, ClientUpdate, Task, TaskEvent, TaskKind, TaskState, Tier
from felix.core.validation import UpdateValidator, ValidationConfig, malformed


class Orchestrator(Dispatch):
    """Turns events into commands. Its concerns each have a module: the tasks and their states in
    ``TaskLedger`` (``felix.core.ledger``), selection and dispatch in ``Dispatch``
    (``felix.core.dispatch``), the waiting updates in ``AggregationBuffer`` (``felix.core.buffer``),
    the counters in ``OrchestratorStats`` (``felix.core.stats``), the strategy decisions in one
    policy per axis. What stays here is their wiring: handling each event, applying an
    aggregation, and the checkpoint that gathers every part's state."""

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
        ``round_policy_params`` / ``availability_params``; pass objects to use others."""
        if initial_weights.ndim != 1:
            raise ValueError("initial_weights must be a flat parameter vector")
        self.cfg = config
        self.selector = selector
        self.aggregator = aggregator
        self.eval_selector = eval_selector or EvalSelector()
        self.rng = rng
        self.oracle = oracle
        self.rounds = round_policy or ROUND_POLICIES.create(
            config.round_policy, config.round_policy_params, config
        )
        self.availability = availability or AVAILABILITY.create(
            config.availability, config.availability_params, config
        )
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
        self.ledger = TaskLedger(
            config.task_timeout_s, config.one_late_task_per_client, config.accept_late, slots=self.clients
        )
        self.buffer = AggregationBuffer()
        self.version = 0
        self.round = 0  # sync: rounds started; async: equals the version
        self.now = 0.0
        self.aux: dict[str, np.ndarray] = {}
        self.plans: dict[int, tuple[int, ...]] = {}
        self._theta = _frozen(initial_weights.astype(np.float32, copy=True))
        self._held: list[int] = []  # training tasks assigned while the data plan is pending, not yet sent
        self._evals_this_round = 0
        self._probe_dropped: set[int] = (
            set()
        )  # clients whose eval task dropped this round: not probed again in it
        self._rejoin_at: float | None = None  # when blocked clients may train again (the stall rule)
        self._stats_ckpt = StatsCheckpoint()
        # privacy.max_participations (set by the run's builder): the user-level cap on updates
        self.max_participations: int | None = None
        # privacy.bands under banded_mf (set by the run's builder): contributions b aggregations apart
        self.separation = Separation()
        self.model_path = ModelPath()

    # ------------------------------------------------------------------ public API
    @property
    def weights(self) -> np.ndarray:
        return self._theta

    def tasks(self) -> list[Task]:
        """The open tasks (holding a slot, or awaiting a late reply)."""
        return self.ledger.tasks()

    def set_data_plan(self, plans: dict[int, tuple[int, ...]]) -> None:
        """Attach each client's row of a data plan (DAFL / LB); it travels with each of its training
        tasks (a client augments once, on the first) so that a client that restarts still gets it."""
        self.plans = dict(plans)

    def next_wakeup(self) -> float | None:
        timer = self.ledger.next_timer()
        times = [] if timer is None else [timer]
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
        self._fill(self.rounds.need(self), out)
        for task in self.ledger.take_expired():
            self.admission.charge(task.client_id, self.now)
            out.append(
                CancelTask(task.task_id, task.client_id, "lost its slot behind an older one still open")
            )
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
            self._reject(ev.client_id, 0, Refusal.BAD_REGISTRATION, "client registered twice", out)
            return
        if ev.num_samples < 0:
            self._reject(
                ev.client_id, 0, Refusal.BAD_REGISTRATION, "negative sample count at registration", out
            )
            return
        if not (-(2**63) <= ev.client_id < 2**63 and ev.num_samples < 2**63):  # the ClientMap's int64 columns
            self._reject(
                ev.client_id,
                0,
                Refusal.BAD_REGISTRATION,
                "client id or sample count beyond 64 bits at registration",
                out,
            )
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
        rec = self.clients.get(ev.client_id)
        if rec is None:
            self._reject(ev.client_id, 0, Refusal.UNKNOWN_CLIENT, "tier change from an unknown client", out)
            return
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
        self.ledger.close(task, TaskEvent.LATE_RESULT if late else TaskEvent.RESULT)
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
        if self.max_participations is not None and rec.times_updated >= self.max_participations:
            self.stats.updates_discarded += 1  # a late reply beyond the cap: never applied
            return
        if not self.separation.allows(rec.client_id, self.version):
            self.stats.updates_discarded += 1  # within the bands of its last contribution
            return
        rec.times_updated += 1
        self.buffer.add(
            BufferedUpdate(rec.client_id, task.task_id, task.base_version, self.now, upd, staleness)
        )
        self.rounds.on_buffered(self, task, out)

    def _on_failed(self, ev: TaskFailed, out: list[Command]) -> None:
        task = self.ledger.get(ev.task_id)
        if task is None or task.client_id != ev.client_id:
            self._reject(
                ev.client_id,
                ev.task_id,
                Refusal.NOT_HOLDER,
                f"failure report for a task it does not hold ({ev.reason})",
                out,
            )
            return
        if task.holds_slot:  # a task that lost its slot earlier was counted as dropped then
            self.admission.dropped(task.client_id, self.now)
            if task.kind is TaskKind.TRAIN:
                self.stats.train_dropped += 1
                self.clients[task.client_id].times_dropped += 1
                self.clients[task.client_id].blocked_round = task.round
            else:
                self._probe_dropped.add(task.client_id)
        self.ledger.close(task, TaskEvent.FAILED)

    # ------------------------------------------------------------------ validation
    def _validate(self, ev: TaskFinished, out: list[Command]) -> tuple[Task, ClientUpdate] | None:
        if ev.client_id not in self.clients:
            self._reject(ev.client_id, ev.task_id, Refusal.UNKNOWN_CLIENT, "unknown client", out)
            return None
        task = self.ledger.get(ev.task_id)
        if task is None:
            closed = self.ledger.closed_state(ev.task_id)
            issued = closed is not None or self.ledger.was_issued(ev.task_id)
            unknown = "result for a closed task" if issued else "result for a task the server never assigned"
            reason = {
                TaskState.DONE: "replayed result: task already applied",
                TaskState.CANCELLED: "result for a cancelled task",
            }.get(closed, unknown)  # type: ignore[arg-type]
            kind = Refusal.TASK_CLOSED if issued else Refusal.UNKNOWN_TASK
            self._reject(ev.client_id, ev.task_id, kind, reason, out)
            return None
        if task.client_id != ev.client_id:
            self._reject(
                ev.client_id,
                ev.task_id,
                Refusal.NOT_HOLDER,
                f"task {ev.task_id} was assigned to another client",
                out,
            )
            return None
        wrong = self.ledger.mismatch(task, ev.kind, ev.version)
        if wrong is not None:
            self._reject(ev.client_id, ev.task_id, *wrong, out)
            return None
        upd = ev.update
        problem = malformed(task.kind, upd, self._theta)
        if problem is not None:
            self._reject(ev.client_id, ev.task_id, Refusal.MALFORMED_UPDATE, problem, out)
            return None
        rec = self.clients[ev.client_id]
        verdict = self.validator.check(
            ev.client_id, task.kind, upd, rec.num_samples, sum(self.plans.get(ev.client_id, ())), self._theta
        )
        if verdict.update is None:
            self._reject(ev.client_id, ev.task_id, Refusal.INVALID_UPDATE, verdict.reason, out)
            return None
        if verdict.clipped:
            self.stats.updates_clipped += 1
        return task, verdict.update

    def _reject(self, client_id: int, task_id: int, kind: Refusal, reason: str, out: list[Command]) -> None:
        self.stats.rejected += 1
        out.append(UpdateRejected(self.now, client_id, task_id, reason, kind))

    # ------------------------------------------------------------------ slots and timers
    def _release(self, task: Task, event: TaskEvent) -> None:
        """A task loses its slot mid-way (``CLIENT_LEFT`` or ``TIMER_FIRED``); its late reply may still
        come (and be accepted), unless the ledger's one-late-task rule closes it (its cancel goes
        out with the event's commands)."""
        self.ledger.release(task, event)
        rec = self.clients[task.client_id]
        self.admission.dropped(task.client_id, self.now)
        if task.kind is TaskKind.TRAIN:
            self.stats.train_dropped += 1
            rec.times_dropped += 1
            rec.blocked_round = task.round
        else:
            # The eval path's rejoin rule: a client that leaves (or times out, or fails) mid-probe
            # is not probed again this round, or each tier flip would cost a full model download.
            self._probe_dropped.add(task.client_id)

    def _fire_timers(self, out: list[Command]) -> None:
        for task in self.ledger.due(self.now):
            queued = task.kind is TaskKind.EVAL and self.late_task(task.client_id) is not None
            self._release(task, TaskEvent.TIMER_FIRED)
            if not (queued and self.cfg.spare_queued_evals):
                self.availability.on_timeout(self, task)
            if not self.cfg.accept_late:
                self._cancel(task, "timed out", out)
        self.rounds.on_timers(self, out)

    def _cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        self.ledger.close(task, TaskEvent.WITHDRAWN)
        if task.kind is TaskKind.TRAIN:
            self.stats.train_cancelled += 1
        self.admission.charge(task.client_id, self.now)
        out.append(CancelTask(task.task_id, task.client_id, reason))

    # ------------------------------------------------------------------ the policies' API (felix.core.view)
    @property
    def buffered(self) -> int:
        """Updates waiting in the aggregation buffer."""
        return len(self.buffer)

    @property
    def train_in_flight(self) -> int:
        """Training tasks holding a slot."""
        return self.ledger.train_in_flight

    def late_task(self, client_id: int) -> int | None:
        """The id of the client's open task that lost its slot (awaiting a late reply), if any."""
        return self.ledger.late_task(client_id)

    def task(self, task_id: int) -> Task:
        """An open task by id."""
        return self.ledger.task(task_id)

    def round_tasks(self, round_: int) -> list[Task]:
        """The open training tasks of round ``round_`` (a list: the caller may cancel them)."""
        return self.ledger.round_tasks(round_)

    def round_in_flight(self, round_: int) -> int:
        """Training tasks of round ``round_`` holding a slot."""
        return self.ledger.round_in_flight(round_)

    def start_round(self, round_: int) -> None:
        """Number the round ``round_``; the eval-probe budget and the probe rejoin rule restart."""
        self.model_path.start_round(self.round, round_)
        self.round = round_
        self._evals_this_round = 0
        self._probe_dropped.clear()

    def aggregate(self, out: list[Command]) -> None:
        """Apply the buffer now (a new model version), or reject what cannot be aggregated.

        All or nothing: if any step after the aggregator's fails (a policy's arithmetic, say),
        everything the aggregation changed is put back (version, round, model, aux, stats,
        policy states, commands) and the buffered updates are rejected, so no version is ever
        half made (a model changed without its version, report and checkpoint)."""
        undo = self._undo_point(len(out))
        try:
            buffer, (theta, norm_w, aux) = self.buffer.aggregate(self.aggregator, self._theta, self.version)
        except (ValueError, ArithmeticError) as exc:
            for b in self.buffer.drop_unaggregatable(self.aggregator, self._theta):
                self._reject(
                    b.client_id,
                    b.task_id,
                    Refusal.UNAGGREGATABLE,
                    f"update cannot be aggregated ({str(exc)[:120]})",
                    out,
                )
            return
        try:
            self._apply_aggregate(buffer, theta, norm_w, aux, out)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the aggregation is undone whole
            self._roll_back(undo, out)
            reason = f"aggregation failed and was rolled back ({type(exc).__name__}: {str(exc)[:120]})"
            for b in buffer:
                self._reject(b.client_id, b.task_id, Refusal.UNAGGREGATABLE, reason, out)

    def _undo_point(self, n_out: int) -> dict[str, Any]:
        """What an aggregation may change, as it stands (``_roll_back`` restores it). The model and
        the aux arrays are replaced, never written in place, so references suffice for them."""
        return {
            "out": n_out,
            "version": self.version,
            "round": self.round,
            "theta": self._theta,
            "aux": dict(self.aux),
            "path_total": self.model_path.total,
            "evals_this_round": self._evals_this_round,
            "probe_dropped": set(self._probe_dropped),
            "stats": self.stats.mark(),
            "rounds": self.rounds.state_dict(),
            "selector": self.selector.state_dict(),
            "aggregator": self.aggregator.state_dict(),
        }

    def _roll_back(self, undo: dict[str, Any], out: list[Command]) -> None:
        del out[undo["out"] :]
        self.version, self.round, self._theta = undo["version"], undo["round"], undo["theta"]
        self.aux = undo["aux"]
        self.model_path.total = undo["path_total"]
        self._evals_this_round = undo["evals_this_round"]
        self._probe_dropped = undo["probe_dropped"]
        self.stats.rewind(undo["stats"])
        self.rounds.load_state_dict(undo["rounds"])
        self.selector.load_state_dict(undo["selector"])
        self.aggregator.load_state_dict(undo["aggregator"])

    def _apply_aggregate(
        self,
        buffer: list[BufferedUpdate],
        theta: np.ndarray,
        norm_w: Any,
        aux: dict[str, Any],
        out: list[Command],
    ) -> None:
        new = theta.astype(np.float32, copy=False)
        self.model_path.moved(self._theta, new)
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
        self.separation.aggregated([b.client_id for b in buffer], self.version)  # last: nothing to undo

    def cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        """Withdraw ``task``: the client is told, and a late reply is rejected."""
        self._cancel(task, reason, out)

    def release(self, task: Task, event: TaskEvent) -> None:
        """``task`` loses its slot (``CLIENT_LEFT`` or ``TIMER_FIRED``); a late reply may still be accepted."""
        self._release(task, event)

    # ------------------------------------------------------------------ checkpoints
    def reserve_task_ids(self, first: int) -> None:
        """Number the next tasks from ``first`` on (at least): a resumed server's fresh id range,
        so that a late result of a task dispatched after the checkpoint cannot match a new task."""
        self.ledger.reserve_ids(first)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed orchestrator needs, as plain values and numpy arrays.

        Explicit on purpose (no reflection over attributes): the config, the oracle and the
        policies' parameters are rebuilt from the config; the ledger, the buffer, the policies and
        the ClientMap give their own ``state_dict``. History is kept as arrays (closed task ids
        above a watermark, the per-update statistics), so saving costs array copies, not a Python
        object each. The ledger's keys sit at the top level, as in checkpoints made before it had
        a module of its own.
        """
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
            **self.ledger.state_dict(),
            "buffer": self.buffer.state_dict(),
            "held": np.array(self._held, dtype=np.int64),
            "evals_this_round": self._evals_this_round,
            "probe_dropped": np.array(sorted(self._probe_dropped), dtype=np.int64),
            **self.model_path.state_dict(self.round),
            "rng": self.rng.bit_generator.state,
            "stats": self._stats_ckpt.state_dict(self.stats),
            "clients": self.clients.state_dict(),
            "selector": self.selector.state_dict(),
            "eval_selector": self.eval_selector.state_dict(),
            "aggregator": self.aggregator.state_dict(),
            "validator": self.validator.state_dict(),
            "round_policy": self.rounds.state_dict(),
            "availability": self.availability.state_dict(),
            "data_plan": self.data_plan.state_dict(),
            "admission": self.admission.state_dict(),
            "separation": self.separation.state_dict(),
        }

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
        self.clients.load_state_dict(state["clients"])
        self.ledger.load_state_dict(state)  # after the clients: it rewrites their in_flight column
        self._rejoin_at = None
        self.buffer.load_state_dict(state["buffer"])
        self._held = np.asarray(state["held"]).tolist()
        self._evals_this_round = int(state["evals_this_round"])
        self._probe_dropped = set(np.asarray(state["probe_dropped"]).tolist())
        self.model_path.load_state_dict(state, self.round)
        self.rng.bit_generator.state = state["rng"]
        self._stats_ckpt.load_state_dict(self.stats, state["stats"])
        self.selector.load_state_dict(state["selector"])
        self.eval_selector.load_state_dict(state["eval_selector"])
        self.aggregator.load_state_dict(state["aggregator"])
        self.validator.load_state_dict(state["validator"])
        self.rounds.load_state_dict(state["round_policy"])
        self.availability.load_state_dict(state["availability"])
        self.data_plan.load_state_dict(state["data_plan"])
        if "admission" in state:  # checkpoints from before admission control start with fresh budgets
            self.admission.load_state_dict(state["admission"])
        if "separation" in state:  # checkpoints from before the rule had no banded_mf runs
            self.separation.load_state_dict(state["separation"])


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


__all__ = ["AvailabilityName", "Orchestrator", "OrchestratorConfig", "OrchestratorStats"]
