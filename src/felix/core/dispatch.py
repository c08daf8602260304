"""Dispatch: whom the orchestrator asks to train or to probe next, and sending their tasks.

One concern of the orchestrator, kept in a file of its own: the eligibility rules over the
``ClientMap`` (availability, admission, the rejoin and stall rules, once per round), the call to
the selectors, opening the task in the ledger and the ``DispatchTrain`` / ``DispatchEval``
command, and the training tasks held back until the data plan exists. ``Orchestrator`` inherits
it; the attributes below are the orchestrator's, named here so that this part reads (and type
checks) on its own.
"""

from __future__ import annotations

import numpy as np

from felix.core.admission import Admission
from felix.core.availability import AvailabilityPolicy
from felix.core.buffer import AggregationBuffer
from felix.core.client_map import ClientMap
from felix.core.commands import Command, DispatchEval, DispatchTrain
from felix.core.dataplan import DataPlanPolicy
from felix.core.eval_selection import EvalSelector
from felix.core.ledger import TaskLedger
from felix.core.orchestrator_config import OrchestratorConfig
from felix.core.rounds import RoundPolicy
from felix.core.selection import AvailabilityOracle, SelectionContext, TrainSelector
from felix.core.separation import Separation
from felix.core.stats import ModelPath, OrchestratorStats
from felix.core.types import TaskEvent, TaskKind, Tier


class Dispatch:
    """Selection and dispatch, as a part of ``Orchestrator``."""

    cfg: OrchestratorConfig
    clients: ClientMap
    ledger: TaskLedger
    admission: Admission
    availability: AvailabilityPolicy
    rounds: RoundPolicy
    selector: TrainSelector
    eval_selector: EvalSelector
    data_plan: DataPlanPolicy
    oracle: AvailabilityOracle | None
    rng: np.random.Generator
    stats: OrchestratorStats
    model_path: ModelPath
    now: float
    version: int
    round: int
    aux: dict[str, np.ndarray]
    plans: dict[int, tuple[int, ...]]
    _theta: np.ndarray
    _held: list[int]  # training tasks assigned while the data plan is pending, not yet sent
    _evals_this_round: int
    _probe_dropped: set[int]  # clients whose eval task dropped this round: not probed again in it
    _rejoin_at: float | None  # when blocked clients may train again (the stall rule)
    max_participations: int | None  # clients that contributed this many updates never train again
    separation: Separation  # clients within the bands of their last contribution do not train
    buffer: AggregationBuffer

    def _ctx(self) -> SelectionContext:
        return SelectionContext(
            self.now, self.round, self.clients, self.rng, self.oracle, self.model_path.upto(self.round)
        )

    def _train_candidates(self) -> np.ndarray:
        """Idle clients that may train now (ids, in id order), from the ClientMap's columns.

        The rejoin rule: a client that dropped its task this round is not picked again in it; in
        sync mode nobody trains twice in one round. One vectorised filter over the idle set.

        The participation cap (``max_participations``): a client that has contributed that many
        updates is never picked again; nor, under a separation rule (``banded_mf``), is a client
        that contributed to one of the last ``bands - 1`` aggregations or has an update buffered.

        The stall rule: when no training task holds a slot and the rejoin rule leaves nobody to pick,
        no reply, timer or new version could ever lift it (async rounds follow the version), so the
        blocked clients may train again ``task_timeout_s`` later (at once without a timeout); until
        then ``next_wakeup`` returns that time.
        """
        m = self.clients
        rows = self.availability.train_rows(m, self.now)
        if self.admission.any_excluded and len(rows):
            rows = rows[self.admission.allowed(m.ids_of(rows))]
        if not len(rows):  # nobody idle, or all of them excluded: nothing to filter
            self._rejoin_at = None
            return m.ids_of(rows)
        if self.max_participations is not None:
            rows = rows[m.column("times_updated")[rows] < self.max_participations]
        if self.separation.active and len(rows):
            blocked = self.separation.blocked([b.client_id for b in self.buffer.items])
            if blocked.size:  # a mask over the rows: cheaper than np.isin on the ids at any population
                out = np.zeros(len(m), dtype=bool)
                out[m.rows_of(blocked)] = True
                rows = rows[~out[rows]]
        fresh = np.ones(len(rows), dtype=bool)
        if self.rounds.one_task_per_round:
            fresh = m.column("selected_round")[rows] != self.round
        keep = fresh & (m.column("blocked_round")[rows] != self.round)
        if keep.all():  # the usual case: nobody to leave out, no copy
            self._rejoin_at = None
            return m.ids_of(rows)
        if keep.any() or self.ledger.train_in_flight > 0 or not fresh.any():
            self._rejoin_at = None
            return m.ids_of(rows[keep])
        if self._rejoin_at is None:
            self._rejoin_at = self.now + (self.cfg.task_timeout_s or 0.0)
        if self.now < self._rejoin_at:
            return m.ids_of(rows[keep])
        self._rejoin_at = None
        return m.ids_of(rows[fresh])

    def _fill(self, need: int, out: list[Command]) -> None:
        """Dispatch ``need`` training tasks (the round policy's count; none if <= 0) and the eval
        probes the eval selector's budget leaves this round."""
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
                cands = cands[~np.isin(cands, self.ledger.owing())]
            if self.admission.any_excluded and len(cands):
                cands = cands[self.admission.allowed(cands)]
            if len(cands):
                for cid in self.eval_selector.select(cands, budget, self._ctx()):
                    self._dispatch(cid, TaskKind.EVAL, out)

    def _dispatch(self, cid: int, kind: TaskKind, out: list[Command]) -> None:
        rec = self.clients[cid]
        task = self.ledger.open(cid, kind, self.version, self.round, self.now)  # refuses a busy client
        self.admission.charge(cid, self.now)
        held = kind is TaskKind.TRAIN and self.data_plan.pending
        if not held:
            self.ledger.start_timer(task, self.now)
        if kind is TaskKind.TRAIN:
            self.stats.train_dispatched += 1
            rec.selected_round = self.round
            rec.times_selected += 1
            utility, duration = rec.stat_utility, rec.last_duration
            if utility is not None:
                self.stats.utility_age_at_selection.append(self.round - rec.last_utility_round)
                self.stats.selected_utility.append(utility)
            else:
                self.stats.never_explored_at_selection += 1
            if duration is not None:
                self.stats.selected_compute_s.append(duration)
            else:
                self.stats.never_trained_at_selection += 1
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

    def _send_held(self, out: list[Command]) -> None:
        """The data plan exists: send the training tasks held for it, in the order they were
        assigned, each with its row and the current model; their timeouts start now."""
        held, self._held = self._held, []
        for tid in held:
            task = self.ledger.get(tid)
            if task is None:
                continue
            if not task.holds_slot:  # it lost its slot while held (its client left): never sent, so closed
                self.ledger.close(task, TaskEvent.NOT_SENT)
                continue
            task.base_version = self.version
            self.ledger.start_timer(task, self.now)
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


__all__ = ["Dispatch"]
