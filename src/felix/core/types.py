"""Vocabulary shared by the orchestrator, its policies and both shells."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np


class Tier(IntEnum):
    """TierTrack's availability tiers; the values are the paper's B[i] codes (Algorithm 1)."""

    UN_AVL = 0
    AVL_EVAL = 1
    AVL_TRAIN = 2

    @classmethod
    def parse(cls, name: str) -> Tier:
        try:
            return cls[name]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; expected one of AVL_TRAIN, AVL_EVAL, UN_AVL") from None


class TaskKind(str, Enum):
    TRAIN = "train"
    EVAL = "eval"


class TaskState(str, Enum):
    """Why a task no longer holds a training slot matters: late updates of some states are still useful."""

    IN_FLIGHT = "in_flight"
    INTERRUPTED = "interrupted"  # client left its tier mid-task; it may resume and reply late
    TIMED_OUT = "timed_out"  # no reply within the task timeout; a late reply is still accepted
    CANCELLED = "cancelled"  # the server no longer wants the result (sync straggler); a reply is rejected
    DONE = "done"


class TaskEvent(str, Enum):
    """What happens to a task: the causes of its state changes (``felix.core.ledger.TRANSITIONS``)."""

    DISPATCHED = "dispatched"  # the orchestrator assigned it (opens it, holding its client's slot)
    CLIENT_LEFT = "client_left"  # its client's tier stopped allowing it (or the client started flapping)
    TIMER_FIRED = "timer_fired"  # no reply within the task timeout
    RESULT = "result"  # its valid result arrived while it held its slot
    LATE_RESULT = "late_result"  # its valid result arrived after it lost its slot
    FAILED = "failed"  # its client reported that it could not run it
    WITHDRAWN = "withdrawn"  # the server no longer wants it (a round ended, or it timed out unwanted)
    NOT_SENT = "not_sent"  # held back for the data plan, it lost its slot before it was ever sent
    SUPERSEDED = "superseded"  # it lost its slot behind an older task of its client still open


@dataclass(slots=True)
class ClientUpdate:
    """What a client sends back. ``delta`` is ``None`` for eval tasks (forward pass only).

    ``aux`` carries small extra state that travels with the model, e.g. FedeRage's beta or
    SCAFFOLD's control-variate delta; the orchestrator reduces it with the same weights as the model.

    ``data_span``: on streaming data, the arrival times (run seconds) of the oldest and newest
    sample the update was trained on, so that an aggregator can weigh by data age; None otherwise.
    """

    num_samples: int
    stat_utility: float
    loss: float
    duration: float
    delta: np.ndarray | None = None
    aux: dict[str, np.ndarray] = field(default_factory=dict)
    data_span: tuple[float, float] | None = None


@dataclass(slots=True)
class Task:
    task_id: int
    client_id: int
    kind: TaskKind
    base_version: int
    round: int
    dispatched_at: float
    state: TaskState = TaskState.IN_FLIGHT

    @property
    def holds_slot(self) -> bool:
        return self.state is TaskState.IN_FLIGHT


@dataclass(slots=True)
class BufferedUpdate:
    """An accepted training update waiting in the aggregation buffer."""

    client_id: int
    task_id: int
    base_version: int
    arrived_at: float
    update: ClientUpdate
    staleness: int = 0
