"""The utility and compute time of the clients picked to train, as the orchestrator knew them at
the pick (FeLiX Fig. 13 / 14): hand-written event sequences whose every selection is known, the
summary's strict-JSON fields, and the checkpoint form."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest

from felix.core.commands import DispatchEval, DispatchTrain
from felix.core.eval_selection import EvalSelector
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.selection import SelectionContext, TrainSelector
from felix.core.stats import OrchestratorStats, StatsCheckpoint
from felix.core.types import ClientUpdate, Tier
from felix.metrics.report import diagnostics
from felix.strategies.aggregation.fedavg import FedBuffAggregator

DIM = 2


class HighestId(TrainSelector):
    """Picks the highest-id candidates, so that every pick below is known in advance."""

    def select(self, candidates: Sequence[int] | np.ndarray, k: int, ctx: SelectionContext) -> list[int]:
        return sorted((int(c) for c in candidates), reverse=True)[:k]


class ProbeOne(EvalSelector):
    """One eval probe per round, the lowest-id idle client."""

    per_round_budget = 1

    def select(self, candidates: Sequence[int] | np.ndarray, budget: int, ctx: SelectionContext) -> list[int]:
        return sorted(int(c) for c in candidates)[:budget]


def make(concurrency: int, eval_selector: EvalSelector | None = None, scale: float = 1.0) -> Orchestrator:
    cfg = OrchestratorConfig(mode="async", concurrency=concurrency, agg_goal=1, eval_utility_scale=scale)
    return Orchestrator(
        cfg,
        np.zeros(DIM, np.float32),
        HighestId(),
        FedBuffAggregator(),
        np.random.default_rng(0),
        eval_selector,
    )


def upd(utility: float, duration: float, train: bool = True) -> ClientUpdate:
    delta = np.ones(DIM, np.float32) if train else None
    return ClientUpdate(num_samples=10, stat_utility=utility, loss=0.5, duration=duration, delta=delta)


def only(cmds: list, kind: type) -> list:
    return [c for c in cmds if isinstance(c, kind)]


def test_each_pick_records_the_utility_and_duration_known_then():
    """Two clients, two slots: both first picks know nothing; after that each finished client is
    picked again at once (the only idle one) with the utility and duration it just reported:
    client 0 (4, 6 s), client 1 (10, 20 s), client 0 (2, 8 s)."""
    o = make(concurrency=2)
    first = [
        t
        for c in (0, 1)
        for t in only(o.handle(ClientRegistered(0.0, c, 100, Tier.AVL_TRAIN)), DispatchTrain)
    ]
    assert [t.client_id for t in first] == [0, 1]
    task = {t.client_id: t.task_id for t in first}
    for now, cid, utility, duration in ((6.0, 0, 4.0, 6.0), (20.0, 1, 10.0, 20.0), (21.0, 0, 2.0, 8.0)):
        (again,) = only(o.handle(TaskFinished(now, cid, task[cid], upd(utility, duration))), DispatchTrain)
        assert again.client_id == cid
        task[cid] = again.task_id
    s = o.stats
    assert (s.selected_utility, s.selected_compute_s) == ([4.0, 10.0, 2.0], [6.0, 20.0, 8.0])
    assert (s.never_explored_at_selection, s.never_trained_at_selection) == (2, 2)
    d = diagnostics(s)
    assert (d["selected_utility_p50"], d["selected_compute_s_p50"]) == (4.0, 8.0)
    assert d["selected_utility_mean"] == pytest.approx(16 / 3)
    assert d["selected_compute_s_mean"] == pytest.approx(34 / 3)
    assert d["selections_never_trained"] == 2


def test_a_probed_client_is_picked_with_its_eval_utility_and_no_duration():
    """One slot, one probe a round: client 0 trains, client 1 is probed (utility 3, scaled by
    eval_utility_scale 2 to 6; an eval's duration is no compute time). Client 0's update makes a
    version and the highest-id pick is client 1: its utility, 6, is known from the probe, its
    compute time is not."""
    o = make(concurrency=1, eval_selector=ProbeOne(), scale=2.0)
    (t0,) = only(o.handle(ClientRegistered(0.0, 0, 100, Tier.AVL_TRAIN)), DispatchTrain)
    (e1,) = only(o.handle(ClientRegistered(0.0, 1, 100, Tier.AVL_TRAIN)), DispatchEval)
    assert e1.client_id == 1
    assert only(o.handle(TaskFinished(1.0, 1, e1.task_id, upd(3.0, 0.5, train=False))), DispatchTrain) == []
    (t1,) = only(o.handle(TaskFinished(7.0, 0, t0.task_id, upd(5.0, 7.0))), DispatchTrain)
    assert t1.client_id == 1
    s = o.stats
    assert (s.selected_utility, s.selected_compute_s) == ([6.0], [])
    assert (s.never_explored_at_selection, s.never_trained_at_selection) == (1, 2)
    d = diagnostics(s)
    assert (d["selected_utility_p50"], d["selected_compute_s_p50"]) == (6.0, None)


def test_no_pick_known_is_null_and_the_lists_survive_a_checkpoint():
    d = diagnostics(OrchestratorStats(train_dispatched=3, never_trained_at_selection=3))
    assert d["selected_utility_p50"] is None and d["selected_compute_s_p50"] is None
    assert d["selected_utility_mean"] is None and d["selected_compute_s_mean"] is None
    json.loads(json.dumps(d), parse_constant=_no_constant)
    stats = OrchestratorStats(
        selected_utility=[1.5, 2.5], selected_compute_s=[3.0], never_trained_at_selection=1
    )
    saved = StatsCheckpoint().state_dict(stats)
    again = OrchestratorStats()
    StatsCheckpoint().load_state_dict(again, saved)
    assert again == stats
    old = {k: v for k, v in saved.items() if k not in ("selected_utility", "selected_compute_s")}
    StatsCheckpoint().load_state_dict(again, old)  # a checkpoint from before these were kept
    assert again.selected_utility == [] and again.selected_compute_s == [] and again.updates_applied == 0


def _no_constant(name: str) -> None:
    raise AssertionError(f"diagnostics hold {name}: not strict JSON")
