"""Commands flowing out of the orchestrator; the shell turns them into messages or simulated work."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from felix.core.refusals import Refusal


@dataclass(frozen=True, slots=True)
class DispatchTrain:
    task_id: int
    client_id: int
    version: int
    weights: np.ndarray = field(repr=False)  # read-only; shells must copy before mutating
    aux: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    plan: tuple[int, ...] = ()  # the client's row of a data plan (DAFL/LB), empty when none


@dataclass(frozen=True, slots=True)
class DispatchEval:
    task_id: int
    client_id: int
    version: int
    weights: np.ndarray = field(repr=False)


@dataclass(frozen=True, slots=True)
class CancelTask:
    task_id: int
    client_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class AggregationReport:
    """Diagnostics of one aggregation (FeLiX §6.3): which updates, how stale, with which weights."""

    client_ids: tuple[int, ...]
    staleness: tuple[int, ...]
    weights: tuple[float, ...]
    losses: tuple[float, ...] = ()  # each update's reported local training loss
    task_ids: tuple[int, ...] = ()  # the task each applied update answered (the shells' audit trail)
    newest_data: float | None = None  # streaming data: arrival time of the newest sample behind these updates


@dataclass(frozen=True, slots=True)
class NewModelVersion:
    version: int
    time: float
    weights: np.ndarray = field(repr=False)
    report: AggregationReport = field(repr=False)


@dataclass(frozen=True, slots=True)
class UpdateRejected:
    """An inbound result the orchestrator refused; the shell logs it. Nothing was applied."""

    time: float
    client_id: int
    task_id: int
    reason: str  # what was wrong, for the log and ``rejected_by_reason``
    kind: Refusal  # the closed set it is counted by


Command = DispatchTrain | DispatchEval | CancelTask | NewModelVersion | UpdateRejected
