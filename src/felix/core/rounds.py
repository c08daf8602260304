"""Round policies: when the orchestrator dispatches training, how much, and when the buffer closes.

DESIGN.md's first axis. ``sync`` runs rounds (select ``ceil(agg_goal * overcommit)`` clients, close
the round at ``agg_goal`` arrivals or the deadline, cancel or keep the stragglers); ``async`` keeps
``concurrency`` tasks in flight and aggregates every ``agg_goal`` buffered updates (FedBuff).

A policy is called by the orchestrator at four points (``need`` before selection,
``on_buffered`` after an update entered the buffer, ``on_aggregated`` after a new model version,
``on_timers`` when time advanced) and acts through the orchestrator's small policy API
(``felix.core.view.OrchestratorView``: ``aggregate``, ``start_round``, ``cancel``, ``round_tasks``,
``buffered``, ``train_in_flight``), not through the orchestrator class itself.
A new policy (semi-async, say) is one subclass registered in ``ROUND_POLICIES`` next to it and
picked by ``orchestrator.round_policy``; the orchestrator is not edited. Its own parameters are its
``params`` model (``orchestrator.round_policy_params``); of the shared settings in ``ROUND_SETTINGS`` it
declares the ones it reads (``reads=(...)``), so that setting another is refused at config read.
"""

from __future__ import annotations

import math
from typing import Any

from felix.core.commands import Command
from felix.core.registry import NoParams, Registry
from felix.core.types import Task
from felix.core.view import OrchestratorView, PolicySettings


class RoundPolicy:
    """Base class; the orchestrator's behaviour is the subclass's, never a test of its name."""

    name = "base"
    #: A client trains at most once per round (sync rounds); otherwise it may be picked again as
    #: soon as it is idle.
    one_task_per_round = False

    def __init__(self, cfg: PolicySettings) -> None:
        self.cfg = cfg

    def need(self, orch: OrchestratorView) -> int:
        """How many more training tasks to dispatch now (<= 0: none)."""
        raise NotImplementedError

    def on_buffered(self, orch: OrchestratorView, task: Task, out: list[Command]) -> None:
        """An accepted update of ``task`` entered the buffer: aggregate or close the round if due."""

    def on_aggregated(self, orch: OrchestratorView) -> None:
        """A new model version was made (before the selector's ``on_round_end``)."""

    def on_timers(self, orch: OrchestratorView, out: list[Command]) -> None:
        """Time advanced to ``orch.now`` (after the task timers fired): act on a deadline."""

    def wakeup(self) -> float | None:
        """The next time this policy needs a ``Tick`` (a round deadline), or None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state (plain values); configuration is rebuilt from the config."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


ROUND_POLICIES: Registry[RoundPolicy] = Registry("round policy", key="orchestrator.round_policy")

#: The orchestrator settings that only some round policies read. A policy declares the ones it
#: reads as its ``reads`` trait, and a config that sets one the chosen policy does not read is
#: refused (``OrchestratorConfig``): ``concurrency`` under ``sync`` would otherwise do nothing.
ROUND_SETTINGS = ("agg_goal", "concurrency", "overcommit", "deadline_s", "cancel_stragglers")


@ROUND_POLICIES.register("async", params=NoParams, reads=("agg_goal", "concurrency"))
class AsyncRounds(RoundPolicy):
    """FedBuff-style buffered asynchrony: ``concurrency`` tasks in flight, a new version every
    ``agg_goal`` buffered updates; the round number follows the model version."""

    name = "async"

    def __init__(self, params: NoParams, cfg: PolicySettings) -> None:
        super().__init__(cfg)
        if cfg.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    def need(self, orch: OrchestratorView) -> int:
        return self.cfg.concurrency - orch.train_in_flight

    def on_buffered(self, orch: OrchestratorView, task: Task, out: list[Command]) -> None:
        if orch.buffered >= self.cfg.agg_goal:
            orch.aggregate(out)

    def on_aggregated(self, orch: OrchestratorView) -> None:
        orch.start_round(orch.version)


@ROUND_POLICIES.register(
    "sync", params=NoParams, reads=("agg_goal", "overcommit", "deadline_s", "cancel_stragglers")
)
class SyncRounds(RoundPolicy):
    """Rounds: over-select ``ceil(agg_goal * overcommit)`` and keep that many arrived or
    outstanding; the round ends at ``agg_goal`` arrivals of its own tasks or at ``deadline_s``,
    cancelling its stragglers when ``cancel_stragglers`` (else their replies arrive stale)."""

    name = "sync"
    one_task_per_round = True

    def __init__(self, params: NoParams, cfg: PolicySettings) -> None:
        super().__init__(cfg)
        self.active = False
        self.deadline: float | None = None
        self.received = 0

    def need(self, orch: OrchestratorView) -> int:
        if not self.active:
            self._start(orch)
        # The over-selection at the start, and a top-up for tasks that failed, timed out or left.
        outstanding = orch.round_in_flight(orch.round)
        return math.ceil(self.cfg.agg_goal * self.cfg.overcommit) - self.received - outstanding

    def on_buffered(self, orch: OrchestratorView, task: Task, out: list[Command]) -> None:
        if task.round == orch.round and self.active:
            self.received += 1
        if self.active and self.received >= self.cfg.agg_goal:
            self._end(orch, out)

    def on_timers(self, orch: OrchestratorView, out: list[Command]) -> None:
        if self.deadline is not None and self.deadline <= orch.now:
            self._end(orch, out)

    def wakeup(self) -> float | None:
        return self.deadline

    def _start(self, orch: OrchestratorView) -> None:
        orch.start_round(orch.round + 1)
        orch.stats.rounds_started += 1
        self.active = True
        self.received = 0
        self.deadline = None if self.cfg.deadline_s is None else orch.now + self.cfg.deadline_s

    def _end(self, orch: OrchestratorView, out: list[Command]) -> None:
        if self.cfg.cancel_stragglers:
            for task in orch.round_tasks(orch.round):
                orch.cancel(task, "round ended", out)
        self.active = False
        self.deadline = None
        if orch.buffered:
            orch.aggregate(out)

    def state_dict(self) -> dict[str, Any]:
        return {"round_active": self.active, "round_deadline": self.deadline, "round_received": self.received}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = bool(state["round_active"])
        rd = state["round_deadline"]
        self.deadline = None if rd is None else float(rd)
        self.received = int(state["round_received"])


__all__ = ["ROUND_POLICIES", "ROUND_SETTINGS", "AsyncRounds", "RoundPolicy", "SyncRounds"]
