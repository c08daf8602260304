"""A live cohort stack split over workers (``run.workers`` with a cohort): one
:class:`~felix.client.cohort.CohortTrainer` per worker, each with its own share of the live tasks,
stepped side by side.

An advance steps every share as far as the due task needs (its remaining steps), each share on one
thread. A task's cohort arithmetic is its own (which tasks share its stack does not change its
update; tests/test_cohort.py), so the split gives every task the update one stack gives it, and the
run is the run of one stack. A joining task goes to the share with the least work left (remaining
steps summed), which keeps the shares' advances about equally long.
"""

from __future__ import annotations

import numpy as np

from felix.client.cohort import CohortStats, CohortTask, CohortTrainer
from felix.client.trainer import ClientData
from felix.client.workers import Workers
from felix.core.types import ClientUpdate


class SplitCohort:
    """The engine's live cohort (:class:`felix.sim.simulation.LiveCohort`) over ``trainers``, one per
    worker of ``workers``; a group of eval tasks is dealt round the trainers as whole-group
    :meth:`train` is (a client's probe sums are its own, whichever clients share its pass)."""

    def __init__(self, trainers: list[CohortTrainer], workers: Workers) -> None:
        if len(trainers) != workers.n:
            raise ValueError(f"{len(trainers)} cohort trainers for {workers.n} workers")
        self.trainers = trainers
        self.workers = workers
        self._share: dict[int, int] = {}  # live task key -> its trainer
        self._advances = 0
        self._probe_calls = 0

    @property
    def stats(self) -> CohortStats:
        """The shares' work summed; advances and probe calls counted once per split call."""
        parts = [t.stats for t in self.trainers]
        return CohortStats(
            advances=self._advances,
            lockstep_steps=sum(p.lockstep_steps for p in parts),
            client_steps=sum(p.client_steps for p in parts),
            probe_calls=self._probe_calls,
            probe_rows=sum(p.probe_rows for p in parts),
        )

    def join(self, key: int, task: CohortTask) -> None:
        work = [t.live_work() for t in self.trainers]
        j = work.index(min(work))
        self.trainers[j].join(key, task)
        self._share[key] = j

    def advance(self, key: int) -> dict[int, ClientUpdate]:
        if key not in self._share:
            raise KeyError(f"task {key} is not in the cohort stack")
        steps = self.trainers[self._share[key]].remaining(key)
        self._advances += 1
        busy = [t for t in self.trainers if t.live_count]
        out: dict[int, ClientUpdate] = {}
        for done in self.workers.map(lambda _, t: t.advance_steps(steps), busy):
            out.update(done)
        for k in out:
            del self._share[k]
        return out

    def drop(self, key: int) -> bool:
        j = self._share.pop(key, None)
        return j is not None and self.trainers[j].drop(key)

    def live(self, key: int) -> CohortTask | None:
        j = self._share.get(key)
        return None if j is None else self.trainers[j].live(key)

    @property
    def live_count(self) -> int:
        return len(self._share)

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]:
        """Train ``tasks`` to the end, dealt round the trainers; one update per task, in order."""
        n = len(self.trainers)
        parts = self.workers.map(lambda w, j: self.trainers[j].train(tasks[j::n]), range(n))
        out: list[ClientUpdate] = [None] * len(tasks)  # type: ignore[list-item]
        for j, part in enumerate(parts):
            out[j::n] = part
        return out

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[ClientUpdate]:
        n = min(len(self.trainers), len(datas))
        self._probe_calls += 1
        parts = self.workers.map(lambda _, j: self.trainers[j].probe(weights[j::n], datas[j::n]), range(n))
        out: list[ClientUpdate] = [None] * len(datas)  # type: ignore[list-item]
        for j, part in enumerate(parts):
            out[j::n] = part
        return out

    def close(self) -> None:
        self.workers.close()
