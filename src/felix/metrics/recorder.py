"""What a run measures: global-model evaluations against virtual time and bytes, the time-to-target
rule, and message byte counts by direction and task kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from felix.core.commands import NewModelVersion
from felix.metrics.convergence import convergence_round

# Every message carries a typed header; the deployment's real encoder has this size order too.
HEADER_BYTES = 64


@dataclass
class ByteCounter:
    down: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0, "control": 0})
    up: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0, "control": 0})

    def add(self, direction: str, kind: str, n: int) -> None:
        getattr(self, direction)[kind] += int(n)

    @property
    def total_down(self) -> int:
        return sum(self.down.values())

    @property
    def total_up(self) -> int:
        return sum(self.up.values())

    @property
    def total(self) -> int:
        return self.total_down + self.total_up


@dataclass(frozen=True)
class EvalRow:
    time_s: float
    version: int
    accuracy: float
    loss: float
    bytes_total: int
    bytes_down: int
    bytes_up: int
    # Of bytes_total, what training and evaluation tasks moved (both directions); the rest is
    # control traffic. Eval traffic is part of the result: each eval task ships the whole model.
    bytes_train: int = 0
    bytes_eval: int = 0
    # The privacy budget spent by this version (privacy on; evaluations.csv has the column then).
    epsilon: float | None = None


@dataclass(frozen=True)
class TrainLossRow:
    """The clients' training loss behind one aggregation: the aggregation-weighted mean of the
    updates' reported local losses (for FedAvg, the sample-weighted mean: the global training
    loss the DAFL paper's convergence rule watches)."""

    version: int
    time_s: float
    loss: float


def reached_target(accs: list[float], target: float, window: int) -> bool:
    """The FeLiX authors' rule: the mean of the last ``window`` accuracies and the last one are both
    at or above the target (and at least ``window`` evaluations exist)."""
    if len(accs) < window or not accs:
        return False
    return float(np.mean(accs[-window:])) >= target and accs[-1] >= target


class Recorder:
    def __init__(
        self,
        evaluate: Callable[[np.ndarray], tuple[float, float]],
        target: float,
        window: int,
        eval_every: int = 1,
    ) -> None:
        if window < 1:
            raise ValueError("target window must be >= 1")
        if eval_every < 0:
            raise ValueError("eval_every must be >= 0 (0: no evaluation at all)")
        self.evaluate = evaluate
        self.target = target
        self.window = window
        self.eval_every = eval_every
        self.bytes = ByteCounter()
        self.rows: list[EvalRow] = []
        self.time_to_target: float | None = None
        self.bytes_to_target: int | None = None
        self.version_at_target: int | None = None
        self.train_losses: list[TrainLossRow] = []
        # Called with every new model version (an experiment may keep the weights it will evaluate).
        self.aggregation_hooks: list[Callable[[NewModelVersion], None]] = []
        # run.per_client_eval: the final model's per-client measures (felix.metrics.per_client).
        self.per_client: Callable[[np.ndarray], dict[str, Any]] | None = None
        # run.converge_threshold / converge_patience: the DAFL paper's training-loss rule.
        self.converge: tuple[float, int] | None = None
        self.converged_at: TrainLossRow | None = None
        self.converged_round: int | None = None
        # Streaming data: accuracy and loss on the class mix at the evaluation's time
        # (felix.metrics.freshness), in place of ``evaluate``'s on the test set as it is.
        self.evaluate_at: Callable[[float, int, np.ndarray], tuple[float, float]] | None = None

    def due(self, version: int) -> bool:
        return self.eval_every > 0 and version % self.eval_every == 0

    def record(
        self, time_s: float, version: int, weights: np.ndarray, epsilon: float | None = None
    ) -> EvalRow:
        if self.evaluate_at is not None:
            acc, loss = self.evaluate_at(time_s, version, weights)
        else:
            acc, loss = self.evaluate(weights)
        b = self.bytes
        row = EvalRow(
            time_s,
            version,
            acc,
            loss,
            b.total,
            b.total_down,
            b.total_up,
            b.down["train"] + b.up["train"],
            b.down["eval"] + b.up["eval"],
            epsilon,
        )
        self.rows.append(row)
        if self.time_to_target is None and reached_target(
            [r.accuracy for r in self.rows], self.target, self.window
        ):
            self.time_to_target = time_s
            self.bytes_to_target = b.total
            self.version_at_target = version
        return row

    def on_aggregation(self, cmd: NewModelVersion) -> None:
        """Note the training loss behind a new model version (none when its updates carry no
        losses) and pass the version to the hooks."""
        report = cmd.report
        if report.losses:
            losses = np.asarray(report.losses, dtype=np.float64)
            w = np.asarray(report.weights, dtype=np.float64)
            loss = (
                float(w @ losses / w.sum())
                if w.shape == losses.shape and w.sum() > 0
                else float(losses.mean())
            )
            self.train_losses.append(TrainLossRow(cmd.version, cmd.time, loss))
            if self.converge is not None and self.converged_at is None:
                r = convergence_round([row.loss for row in self.train_losses], *self.converge)
                if r is not None:
                    self.converged_round, self.converged_at = r, self.train_losses[r - 1]
        for hook in self.aggregation_hooks:
            hook(cmd)

    @property
    def reached(self) -> bool:
        return self.time_to_target is not None
