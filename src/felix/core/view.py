"""What a round or availability policy may see of the orchestrator, and of its settings.

The policies (``felix.core.rounds``, ``felix.core.availability``) act on the orchestrator: they
aggregate, start rounds, cancel or release tasks. They depend on these two protocols instead of
on ``Orchestrator`` itself, so the orchestrator imports its policies and nothing imports back,
and a policy's author reads here, in one screen, everything a policy can touch. ``Orchestrator``
satisfies ``OrchestratorView`` and ``OrchestratorConfig`` satisfies ``PolicySettings``; a test may
pass any object that does.
"""

from __future__ import annotations

from typing import Protocol

from felix.core.client_map import ClientMap
from felix.core.commands import Command
from felix.core.stats import OrchestratorStats
from felix.core.types import Task, TaskEvent


class PolicySettings(Protocol):
    """The orchestrator settings that the built-in policies read."""

    @property
    def agg_goal(self) -> int: ...

    @property
    def concurrency(self) -> int: ...

    @property
    def overcommit(self) -> float: ...

    @property
    def deadline_s(self) -> float | None: ...

    @property
    def cancel_stragglers(self) -> bool: ...

    @property
    def task_timeout_s(self) -> float | None: ...


class OrchestratorView(Protocol):
    """The orchestrator as its round and availability policies see it."""

    #: The time of the event being handled (run seconds).
    now: float
    #: The model version (aggregations so far).
    version: int
    #: The current round (sync) or model version (async).
    round: int
    #: Every registered client's record (tiers, slots, utilities).
    clients: ClientMap
    #: Counters the metrics layer reports (a policy counts the rounds it starts).
    stats: OrchestratorStats

    @property
    def buffered(self) -> int:
        """Updates waiting in the aggregation buffer."""
        ...

    @property
    def train_in_flight(self) -> int:
        """Training tasks holding a slot."""
        ...

    def task(self, task_id: int) -> Task:
        """An open task by id."""
        ...

    def round_tasks(self, round_: int) -> list[Task]:
        """The open training tasks of round ``round_``."""
        ...

    def round_in_flight(self, round_: int) -> int:
        """Training tasks of round ``round_`` holding a slot."""
        ...

    def start_round(self, round_: int) -> None:
        """Number the round ``round_``; the eval-probe budget and probe rejoin rule restart."""
        ...

    def aggregate(self, out: list[Command]) -> None:
        """Apply the buffer now (a new model version)."""
        ...

    def cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        """Withdraw ``task``: the client is told, and a late reply is rejected."""
        ...

    def release(self, task: Task, event: TaskEvent) -> None:
        """``task`` loses its slot (``CLIENT_LEFT`` or ``TIMER_FIRED``); a late reply may still be accepted."""
        ...


__all__ = ["OrchestratorView", "PolicySettings"]
