"""Sequential trainers on workers (``run.workers`` where clients train one at a time, e.g. a CNN on
a CPU): the engine's whole-group cohort executor (:class:`felix.sim.simulation.CohortExecutor`) whose
group is trained by :class:`~felix.client.trainer.LocalTrainer` s, one per worker, each task on one
thread.

A task's update depends only on its weights, data, state and seed, so training it on any worker,
and before its completion, gives the update the sequential trainer gives it at ``run.threads`` 1.
"""

from __future__ import annotations

import numpy as np

from felix.client.cohort import CohortTask
from felix.client.trainer import ClientData, LocalTrainer
from felix.client.workers import Workers
from felix.core.types import ClientUpdate

# Tasks trained per group, per worker: the due task and the next ones due. Workers take a group's
# tasks one at a time, the largest first (a task's cost is its client's samples), so a group of a
# few per worker keeps them all busy until its end however unequal the tasks; more would train
# further ahead (a task cancelled after it was trained is wasted).
TASKS_PER_WORKER = 3


class TrainerPool:
    """``trainers[w]`` is worker ``w``'s workspace (its own model copy and objective instance)."""

    def __init__(self, trainers: list[LocalTrainer], workers: Workers) -> None:
        if len(trainers) != workers.n:
            raise ValueError(f"{len(trainers)} trainers for {workers.n} workers")
        self.trainers = trainers
        self.workers = workers

    @property
    def group_size(self) -> int:
        return TASKS_PER_WORKER * self.workers.n

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]:
        def one(w: int, t: CohortTask) -> ClientUpdate:
            return self.trainers[w].train(t.weights, t.data, t.state, t.aux_in, t.generator)

        return self.workers.map(one, tasks, cost=[len(t.data) for t in tasks])

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[ClientUpdate]:
        return self.workers.map(
            lambda w, k: self.trainers[w].probe(weights[k], datas[k]),
            range(len(datas)),
            cost=[len(d) for d in datas],
        )

    def close(self) -> None:
        self.workers.close()
