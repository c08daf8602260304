"""TierSelect's eval path: the rate limit, the staleness threshold, stalest first; and a FeLiX run."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from felix.core.client_map import ClientMap, ClientRecord
from felix.core.commands import Command, DispatchEval, DispatchTrain, NewModelVersion
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.selection import SelectionContext
from felix.core.types import ClientUpdate, Tier
from felix.strategies.aggregation.tierfuse import TierFuseAggregator
from felix.strategies.selection.oort import OortParams, OortSelector
from felix.strategies.selection.tierselect import TierSelectEval, TierSelectEvalParams, tierselect


def ctx_for(last_rounds: dict[int, int], round_: int) -> SelectionContext:
    m = ClientMap()
    for cid, last in last_rounds.items():
        m.add(
            ClientRecord(
                client_id=cid,
                num_samples=10,
                tier=Tier.AVL_EVAL,
                reported_tier=Tier.AVL_EVAL,
                stat_utility=None if last < 0 else 1.0,
                last_utility_round=last,
            )
        )
    return SelectionContext(now=0.0, round=round_, clients=m, rng=np.random.default_rng(0))


def test_budget_is_int_of_eval_goal_factor_times_agg_goal():
    assert TierSelectEval(10).per_round_budget == 15  # int(1.5 * 10)
    assert TierSelectEval(3).per_round_budget == 4  # int(4.5)
    assert TierSelectEval(10, TierSelectEvalParams(eval_goal_factor=0.5)).per_round_budget == 5


def test_only_utilities_older_than_the_threshold_stalest_first():
    # round 50, threshold 35: ages 40, 35, 34, never, 45, 40
    c = ctx_for({0: 10, 1: 15, 2: 16, 3: -1, 4: 5, 5: 10}, round_=50)
    sel = TierSelectEval(10)
    # eligible: 3 (never measured, stalest), 4 (5), 0 and 5 (10, tie -> id order), 1 (15, age exactly 35)
    assert sel.select([0, 1, 2, 3, 4, 5], 15, c) == [3, 4, 0, 5, 1]
    assert sel.select([5, 4, 3, 2, 1, 0], 2, c) == [3, 4]  # at most the budget; order independent of input
    authors = TierSelectEval(10, TierSelectEvalParams(include_unmeasured=False))
    assert authors.select([0, 1, 2, 3, 4, 5], 15, c) == [4, 0, 5, 1]  # the authors' fork skips never-measured


def test_nothing_eligible_or_no_budget():
    c = ctx_for({0: 40, 1: 49}, round_=50)
    assert TierSelectEval(10).select([0, 1], 15, c) == []
    assert TierSelectEval(10).select([0, 1], 0, ctx_for({0: -1}, 50)) == []


@pytest.mark.parametrize("kwargs", [{"eval_goal_factor": -1.0}, {"staleness_threshold": -1}])
def test_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        TierSelectEvalParams(**kwargs)


def test_agg_goal_is_validated():
    with pytest.raises(ValueError):
        TierSelectEval(0)


def test_tierselect_helper_builds_the_felix_pair():
    train, ev = tierselect(10, reward_cap=640, pacer_step=10)
    assert isinstance(train, OortSelector) and isinstance(ev, TierSelectEval)
    assert train.params == OortParams(**{**_fields(OortParams.felix_authors()), "pacer_step": 10})
    assert train.reward_cap == 640
    assert ev.per_round_budget == 15


def _fields(p: OortParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_tierselect_dispatches_rate_limited_evals_under_tiertrack():
    """Clients 0-9 AVL_TRAIN, 10-19 AVL_EVAL: evals go out, at most int(1.5 * agg_goal) per version."""
    agg_goal = 4
    train_sel, eval_sel = tierselect(agg_goal, TierSelectEvalParams(staleness_threshold=2))
    cfg = OrchestratorConfig(
        mode="async", agg_goal=agg_goal, concurrency=5, knowledge=AvailabilityName.TIERTRACK
    )
    orch = Orchestrator(
        cfg,
        np.zeros(5, np.float32),
        train_sel,
        TierFuseAggregator(),
        np.random.default_rng(0),
        eval_selector=eval_sel,
    )
    rng = np.random.default_rng(1)
    heap: list = []
    seq = itertools.count()
    log: list[Command] = []

    def emit(cmds: list[Command], now: float) -> None:
        for c in cmds:
            log.append(c)
            if isinstance(c, (DispatchTrain, DispatchEval)):
                train = isinstance(c, DispatchTrain)
                dur = 1.0 + c.client_id % 5 if train else 0.05
                upd = ClientUpdate(
                    num_samples=10,
                    stat_utility=float(rng.uniform(1, 50)),
                    loss=1.0,
                    duration=dur,
                    delta=rng.standard_normal(5).astype(np.float32) if train else None,
                )
                heapq.heappush(heap, (now + dur, next(seq), c.client_id, c.task_id, upd))

    for cid in range(20):
        emit(orch.handle(ClientRegistered(0.0, cid, 10, Tier.AVL_TRAIN if cid < 10 else Tier.AVL_EVAL)), 0.0)
    while heap and orch.version < 10:
        t, _, cid, tid, upd = heapq.heappop(heap)
        emit(orch.handle(TaskFinished(t, cid, tid, upd)), t)

    assert orch.version == 10
    budget = int(1.5 * agg_goal)
    per_version = [0]
    for c in log:
        if isinstance(c, NewModelVersion):
            per_version.append(0)
        elif isinstance(c, DispatchEval):
            per_version[-1] += 1
    assert max(per_version) <= budget
    evals = [c for c in log if isinstance(c, DispatchEval)]
    assert {c.client_id for c in evals} >= set(range(10, 20))  # every AVL_EVAL client was probed
    assert all(c.client_id < 10 for c in log if isinstance(c, DispatchTrain))  # only AVL_TRAIN trains
    assert all(orch.clients[c].explored for c in range(10, 20))  # eval utilities reached the ClientMap


def test_value_order_probes_high_utility_long_unmeasured_clients_first():
    m = ClientMap()
    # (utility, last measured round) at round 50, threshold 35: values 2*40=80, 5*36=180, 1*45=45; 3 too fresh
    for cid, (u, last) in {0: (2.0, 10), 1: (5.0, 14), 2: (1.0, 5), 3: (9.0, 40), 4: (None, -1)}.items():
        m.add(
            ClientRecord(
                client_id=cid,
                num_samples=10,
                tier=Tier.AVL_EVAL,
                reported_tier=Tier.AVL_EVAL,
                stat_utility=u,
                last_utility_round=last,
            )
        )
    c = SelectionContext(now=0.0, round=50, clients=m, rng=np.random.default_rng(0))
    value = TierSelectEval(10, TierSelectEvalParams(order="value"))
    assert value.select([0, 1, 2, 3, 4], 15, c) == [4, 1, 0, 2]  # never measured first, then by value
    assert value.select([4, 3, 2, 1, 0], 2, c) == [4, 1]
    measured_only = TierSelectEval(10, TierSelectEvalParams(order="value", include_unmeasured=False))
    assert measured_only.select([0, 1, 2, 3, 4], 2, c) == [1, 0]
    assert TierSelectEval(10).select([0, 1, 2, 3, 4], 15, c) == [4, 2, 0, 1]  # the paper's stalest first
    with pytest.raises(ValueError):
        TierSelectEvalParams(order="random")  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_eval_utility_scale_multiplies_eval_utilities_only(scale):
    """One AVL_TRAIN and one AVL_EVAL client: the eval reply's utility is scaled, the training one's not."""
    cfg = OrchestratorConfig(
        mode="async",
        agg_goal=1,
        concurrency=1,
        knowledge=AvailabilityName.TIERTRACK,
        eval_utility_scale=scale,
    )
    train_sel, eval_sel = tierselect(1, TierSelectEvalParams(staleness_threshold=0))
    orch = Orchestrator(
        cfg,
        np.zeros(3, np.float32),
        train_sel,
        TierFuseAggregator(),
        np.random.default_rng(0),
        eval_selector=eval_sel,
    )
    cmds = orch.handle(ClientRegistered(0.0, 0, 10, Tier.AVL_TRAIN)) + orch.handle(
        ClientRegistered(0.0, 1, 10, Tier.AVL_EVAL)
    )
    tasks = {type(c): c for c in cmds if isinstance(c, (DispatchTrain, DispatchEval))}
    ev, tr = tasks[DispatchEval], tasks[DispatchTrain]
    assert (ev.client_id, tr.client_id) == (1, 0)
    orch.handle(TaskFinished(1.0, 1, ev.task_id, ClientUpdate(10, 40.0, 1.0, 0.05)))
    orch.handle(
        TaskFinished(2.0, 0, tr.task_id, ClientUpdate(10, 40.0, 1.0, 2.0, delta=np.ones(3, np.float32)))
    )
    assert orch.clients[1].stat_utility == pytest.approx(40.0 * scale)
    assert orch.clients[0].stat_utility == pytest.approx(40.0)


def test_eval_utility_scale_must_be_positive():
    with pytest.raises(ValueError):
        OrchestratorConfig(eval_utility_scale=0.0)
