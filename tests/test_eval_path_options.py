"""felix-plus's eval-path options (issue 12): probes skipped when the model has barely moved since a
client's utility was measured, and eval timeouts that do not mark a busy client unavailable."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_tierselect import ctx_for

from felix.core.commands import DispatchEval, DispatchTrain
from felix.core.events import ClientRegistered, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.strategies.aggregation.fedavg import FedAvgAggregator
from felix.strategies.aggregation.tierfuse import TierFuseAggregator
from felix.strategies.selection.tierselect import TierSelectEval, TierSelectEvalParams, tierselect


def test_model_path_sums_each_steps_relative_norm_by_round():
    """Two aggregations of known steps: the path grows by |step| / |new model| each, indexed by round."""
    cfg = OrchestratorConfig(mode="async", agg_goal=1, concurrency=1)
    train_sel, _ = tierselect(1)
    orch = Orchestrator(
        cfg, np.array([3.0, 4.0], np.float32), train_sel, FedAvgAggregator(), np.random.default_rng(0)
    )
    cmds = orch.handle(ClientRegistered(0.0, 0, 10))
    for t, delta in ((1.0, [3.0, 4.0]), (2.0, [0.0, 0.0])):  # the model doubles, then stays
        tid = next(c.task_id for c in cmds if isinstance(c, DispatchTrain))
        upd = ClientUpdate(10, 1.0, 1.0, 1.0, delta=np.array(delta, np.float32))
        cmds = orch.handle(TaskFinished(t, 0, tid, upd))
    path = orch._ctx().model_path
    assert orch.round == 2 and path is not None
    np.testing.assert_allclose(path, [0.0, 5.0 / 10.0, 0.5])  # |(3,4)| / |(6,8)|, then no move
    restored = Orchestrator(
        cfg, np.zeros(2, np.float32), tierselect(1)[0], FedAvgAggregator(), np.random.default_rng(0)
    )
    restored.load_state_dict(orch.state_dict())
    np.testing.assert_array_equal(restored._ctx().model_path, path)
    old = {k: v for k, v in orch.state_dict().items() if not k.startswith("model_path")}
    restored.load_state_dict(old)  # a checkpoint from before the path was kept: it restarts at 0
    np.testing.assert_array_equal(restored._ctx().model_path, np.zeros(3))


def test_min_model_change_skips_clients_measured_on_a_model_that_barely_moved():
    ctx = ctx_for({0: 10, 1: 30, 2: -1}, 50)  # all stale enough (threshold 0 below); 2 never measured
    ctx.model_path = np.concatenate([np.zeros(20), np.full(31, 0.3)])  # moved 0.3 at round 20
    off = TierSelectEval(10, TierSelectEvalParams(staleness_threshold=0))
    assert off.select([0, 1, 2], 15, ctx) == [2, 0, 1]
    on = TierSelectEval(10, TierSelectEvalParams(staleness_threshold=0, min_model_change=0.2))
    assert on.select([0, 1, 2], 15, ctx) == [2, 0]  # 1 was measured after the model last moved
    strict = TierSelectEval(10, TierSelectEvalParams(staleness_threshold=0, min_model_change=0.31))
    assert strict.select([0, 1, 2], 15, ctx) == [2]
    ctx.model_path = None
    with pytest.raises(ValueError, match="model's path"):
        on.select([0, 1], 15, ctx)
    with pytest.raises(ValueError):
        TierSelectEvalParams(min_model_change=-0.1)


def _tiertrack_orchestrator(**cfg_kw: Any) -> Orchestrator:
    """Async, one slot, TierTrack, TierSelect probing whoever is AVL_EVAL (staleness threshold 0)."""
    cfg = OrchestratorConfig(
        mode="async", agg_goal=1, concurrency=1, knowledge=AvailabilityName.TIERTRACK, **cfg_kw
    )
    train_sel, eval_sel = tierselect(1, TierSelectEvalParams(staleness_threshold=0))
    return Orchestrator(
        cfg,
        np.zeros(3, np.float32),
        train_sel,
        TierFuseAggregator(),
        np.random.default_rng(0),
        eval_selector=eval_sel,
    )


def _probe_behind_paused_training(**cfg_kw: bool) -> tuple[Orchestrator, list[object]]:
    """Client 0 trains, goes AVL_EVAL (its training task pauses and loses its slot) and is probed;
    its eval waits behind the paused task past the timeout."""
    orch = _tiertrack_orchestrator(task_timeout_s=90.0, **cfg_kw)
    first = orch.handle(ClientRegistered(0.0, 0, 10, Tier.AVL_TRAIN))
    assert [type(c) for c in first] == [DispatchTrain]
    probes = orch.handle(TierChanged(1.0, 0, Tier.AVL_EVAL))
    return orch, probes


def test_eval_timeout_behind_a_paused_training_task_marks_unavailable_by_default():
    orch, probes = _probe_behind_paused_training()
    assert [type(c) for c in probes] == [DispatchEval]
    orch.handle(Tick(95.0))
    assert orch.clients[0].tier is Tier.UN_AVL  # the paper's TierTrack: a timeout means gone


def test_spare_queued_evals_keeps_the_reported_tier():
    orch, probes = _probe_behind_paused_training(spare_queued_evals=True)
    assert [type(c) for c in probes] == [DispatchEval]
    orch.handle(Tick(95.0))
    assert orch.clients[0].tier is Tier.AVL_EVAL
    assert orch.clients[0].in_flight is None  # the eval lost its slot; a late reply is still taken
    assert [t.kind for t in orch.tasks()] == [TaskKind.TRAIN, TaskKind.EVAL]


def test_spare_queued_evals_still_marks_a_silent_idle_client():
    """Nothing older is owed: the eval timed out on its own, so the client looks gone."""
    orch = _tiertrack_orchestrator(spare_queued_evals=True)
    assert [type(c) for c in orch.handle(ClientRegistered(0.0, 1, 10, Tier.AVL_EVAL))] == [DispatchEval]
    orch.handle(Tick(95.0))
    assert orch.clients[1].tier is Tier.UN_AVL


def test_probe_busy_clients_off_skips_clients_owing_a_reply():
    orch, probes = _probe_behind_paused_training(probe_busy_clients=False)
    assert probes == []
    assert orch.clients[0].in_flight is None and orch.clients[0].tier is Tier.AVL_EVAL
