"""Events flowing into the orchestrator. Time always arrives inside an event: the core never reads a clock."""

from __future__ import annotations

from dataclasses import dataclass, field

from felix.core.types import ClientUpdate, TaskKind, Tier


@dataclass(frozen=True, slots=True)
class ClientRegistered:
    time: float
    client_id: int
    num_samples: int
    tier: Tier = Tier.AVL_TRAIN
    class_counts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TierChanged:
    time: float
    client_id: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class TaskFinished:
    """A client's result for ``task_id``. ``kind`` and ``version`` say what the client computed
    (a deployment's result carries both on the wire); the ledger checks them against the task it
    issued (``TaskLedger.mismatch``). None: not stated (a caller that holds the task itself)."""

    time: float
    client_id: int
    task_id: int
    update: ClientUpdate = field(repr=False)
    kind: TaskKind | None = None
    version: int | None = None


@dataclass(frozen=True, slots=True)
class TaskFailed:
    time: float
    client_id: int
    task_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Delivered by the shell at (or after) ``Orchestrator.next_wakeup()`` so timers can fire."""

    time: float


Event = ClientRegistered | TierChanged | TaskFinished | TaskFailed | Tick
