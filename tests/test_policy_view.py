"""The round and availability policies act through ``felix.core.view`` alone: driven here by a
small stand-in for the orchestrator (no ``Orchestrator`` is built), they make the decisions the
orchestrator's tests see, and they touch nothing the view does not name."""

from __future__ import annotations

from dataclasses import dataclass, field

from felix.core.availability import AVAILABILITY
from felix.core.client_map import ClientMap, ClientRecord
from felix.core.commands import CancelTask, Command
from felix.core.ledger import TaskLedger
from felix.core.orchestrator_config import OrchestratorConfig
from felix.core.rounds import ROUND_POLICIES
from felix.core.stats import OrchestratorStats
from felix.core.types import Task, TaskEvent, TaskKind, TaskState, Tier
from felix.core.view import OrchestratorView


@dataclass
class StandIn:
    """Everything ``felix.core.view.OrchestratorView`` names, and nothing more, over a real ledger
    and client map, recording the calls that act."""

    now: float = 0.0
    version: int = 0
    round: int = 0
    clients: ClientMap = field(default_factory=ClientMap)
    stats: OrchestratorStats = field(default_factory=OrchestratorStats)
    _ledger: TaskLedger = field(init=False)
    pending: int = 0  # updates in the buffer
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ledger = TaskLedger(slots=self.clients)  # the ledger writes the map's in_flight column

    @property
    def buffered(self) -> int:
        return self.pending

    @property
    def train_in_flight(self) -> int:
        return self._ledger.train_in_flight

    def task(self, task_id: int) -> Task:
        return self._ledger.task(task_id)

    def round_tasks(self, round_: int) -> list[Task]:
        return self._ledger.round_tasks(round_)

    def round_in_flight(self, round_: int) -> int:
        return self._ledger.round_in_flight(round_)

    def start_round(self, round_: int) -> None:
        self.calls.append(f"start_round {round_}")
        self.round = round_

    def aggregate(self, out: list[Command]) -> None:
        self.calls.append(f"aggregate {self.pending}")
        self.pending = 0
        self.version += 1

    def cancel(self, task: Task, reason: str, out: list[Command]) -> None:
        self._ledger.close(task, TaskEvent.WITHDRAWN)
        out.append(CancelTask(task.task_id, task.client_id, reason))

    def release(self, task: Task, event: TaskEvent) -> None:
        self.calls.append(f"release {task.task_id} {event.value}")
        self._ledger.release(task, event)


def test_the_stand_in_offers_nothing_the_view_does_not_name() -> None:
    """Otherwise a policy reaching past the view (say, into the ledger) would pass here and fail on
    an orchestrator whose view hides it."""
    named = set(OrchestratorView.__annotations__) | {
        n for n in vars(OrchestratorView) if not n.startswith("_")
    }
    offered = {n for n in dir(StandIn()) if not n.startswith("_")} - {"pending", "calls"}
    assert offered == named


def _view(**cfg: object) -> tuple[StandIn, OrchestratorConfig]:
    view = StandIn()
    for cid in range(4):
        view.clients.add(
            ClientRecord(client_id=cid, num_samples=10, tier=Tier.AVL_TRAIN, reported_tier=Tier.AVL_TRAIN)
        )
    return view, OrchestratorConfig(**cfg)


def test_async_rounds_keep_concurrency_and_aggregate_at_the_goal() -> None:
    view, cfg = _view(mode="async", agg_goal=2, concurrency=3)
    policy = ROUND_POLICIES.create("async", None, cfg)
    assert policy.need(view) == 3
    tasks = [view._ledger.open(c, TaskKind.TRAIN, 0, 0, 0.0) for c in range(2)]
    assert policy.need(view) == 1
    out: list[Command] = []
    view.pending = 1
    policy.on_buffered(view, tasks[0], out)
    assert view.calls == []  # below the goal
    view.pending = 2
    policy.on_buffered(view, tasks[1], out)
    policy.on_aggregated(view)
    assert view.calls == ["aggregate 2", "start_round 1"]  # the round follows the version


def test_sync_round_over_selects_then_cancels_its_stragglers_at_the_deadline() -> None:
    view, cfg = _view(mode="sync", agg_goal=2, overcommit=1.5, deadline_s=10.0)
    policy = ROUND_POLICIES.create("sync", None, cfg)
    assert policy.need(view) == 3 and view.round == 1 and view.stats.rounds_started == 1
    tasks = [view._ledger.open(c, TaskKind.TRAIN, 0, view.round, 0.0) for c in range(3)]
    assert policy.need(view) == 0 and policy.wakeup() == 10.0
    out: list[Command] = []
    view._ledger.close(tasks[0], TaskEvent.RESULT)
    view.pending = 1
    policy.on_buffered(view, tasks[0], out)
    view.now = 10.0
    policy.on_timers(view, out)
    assert sorted(c.task_id for c in out if isinstance(c, CancelTask)) == [tasks[1].task_id, tasks[2].task_id]
    assert view.calls[-1] == "aggregate 1" and policy.wakeup() is None
    assert len(view._ledger) == 0


def test_tiertrack_frees_the_slot_of_a_client_that_leaves_and_marks_a_silent_one() -> None:
    view, cfg = _view(knowledge="tiertrack")
    policy = AVAILABILITY.create("tiertrack", None, cfg)
    task = view._ledger.open(1, TaskKind.TRAIN, 0, 0, 0.0)
    rec = view.clients[1]
    assert rec.in_flight == task.task_id
    policy.on_tier(view, rec, Tier.UN_AVL)
    assert view.calls == [f"release {task.task_id} client_left"] and task.state is TaskState.INTERRUPTED
    assert rec.in_flight is None
    assert view.clients[1].tier is Tier.UN_AVL
    policy.on_timeout(view, view._ledger.open(2, TaskKind.EVAL, 0, 0, 0.0))
    assert view.clients[2].tier is Tier.UN_AVL
