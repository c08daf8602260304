"""REFL: IPS priority from a fake oracle, SAA weights by hand, and both inside a sync run."""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np
import pytest

from felix.core.client_map import ClientMap, ClientRecord
from felix.core.commands import Command, DispatchTrain, NewModelVersion
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.selection import SelectionContext
from felix.core.types import BufferedUpdate, ClientUpdate, Tier
from felix.strategies.aggregation.refl_saa import ReflSAAAggregator, ReflSAAParams
from felix.strategies.selection.oort import OortParams, OortSelector
from felix.strategies.selection.refl import ReflIPSParams, ReflIPSSelector


class LeaveOracle:
    """Every client is online from t = 0 until ``leave[cid]`` and then gone."""

    def __init__(self, leave: dict[int, float]) -> None:
        self.leave = leave

    def tier_at(self, client_id: int, t: float) -> Tier:
        return Tier.AVL_TRAIN if t < self.leave[client_id] else Tier.UN_AVL

    def available_throughout(self, client_id: int, t0: float, t1: float) -> bool:
        return 0.0 <= t0 and t1 <= self.leave[client_id]


def clients(n: int, selected_round: int = -1) -> ClientMap:
    m = ClientMap()
    for cid in range(n):
        m.add(
            ClientRecord(
                client_id=cid,
                num_samples=10,
                tier=Tier.AVL_TRAIN,
                reported_tier=Tier.AVL_TRAIN,
                selected_round=selected_round,
            )
        )
    return m


def ctx(
    m: ClientMap, oracle: LeaveOracle | None, now: float = 0.0, round_: int = 10, seed: int = 0
) -> SelectionContext:
    return SelectionContext(now=now, round=round_, clients=m, rng=np.random.default_rng(seed), oracle=oracle)


# ---------------------------------------------------------------------------- IPS
def test_priority_marks_clients_about_to_leave():
    # w = 100 s at now = 0: slot 1 = [0, 100], slot 2 = [100, 200]
    oracle = LeaveOracle({0: 150.0, 1: 250.0, 2: 50.0, 3: 200.0})
    sel = ReflIPSSelector()
    c = ctx(clients(4), oracle)
    assert sel.priority(0, c) == 1  # online through slot 1, gone during slot 2
    assert sel.priority(1, c) == 0  # online through both slots: no hurry
    assert sel.priority(2, c) == 0  # not even online through slot 1
    assert sel.priority(3, c) == 0  # online through both (leaves exactly at 200)
    assert sel.priority(0, ctx(clients(4), oracle, now=60.0)) == 0  # [60, 160] not covered


def test_priority_clients_are_taken_first_then_random_fill():
    # clients 0-3 leave at 150 (priority), 4-19 stay; avail_probability 0 keeps all priority ones
    oracle = LeaveOracle({c: (150.0 if c < 4 else 1e9) for c in range(20)})
    sel = ReflIPSSelector(ReflIPSParams(avail_probability=0.0))
    for seed in range(10):
        picked = sel.select(list(range(20)), 6, ctx(clients(20), oracle, seed=seed))
        assert len(picked) == 6 and len(set(picked)) == 6
        assert set(range(4)) <= set(picked)  # all four about-to-leave clients


def test_avail_probability_keeps_a_random_fraction_of_priority_clients():
    # 10 priority clients, probability 0.9 -> int(10 * 0.9) = 9 kept; K = 9 -> exactly those 9
    oracle = LeaveOracle({c: (150.0 if c < 10 else 1e9) for c in range(20)})
    sel = ReflIPSSelector(ReflIPSParams(avail_probability=0.9))
    dropped = set()
    for seed in range(20):
        picked = sel.select(list(range(20)), 9, ctx(clients(20), oracle, seed=seed))
        assert set(picked) <= set(range(10))
        dropped |= set(range(10)) - set(picked)
    assert len(dropped) > 1  # a different priority client is left out across seeds


def test_prohibit_reselect_skips_recent_trainers():
    oracle = LeaveOracle({c: 1e9 for c in range(10)})
    m = clients(10)
    for cid in range(5):
        m[cid].selected_round = 8  # ran 2 rounds ago, round 10: 10 - 8 < 5
    m[5].selected_round = 5  # 10 - 5 = 5: allowed again
    sel = ReflIPSSelector(ReflIPSParams(avail_probability=0.0))
    for seed in range(10):
        assert set(sel.select(list(range(10)), 4, ctx(m, oracle, seed=seed))) <= set(range(5, 10))
    # more wanted than allowed: the recent ones fill the gap
    assert len(sel.select(list(range(10)), 7, ctx(m, oracle))) == 7


def test_oort_makes_the_final_choice_when_given():
    oracle = LeaveOracle({c: 1e9 for c in range(10)})
    oort = OortSelector(OortParams.fedscale())
    sel = ReflIPSSelector(ReflIPSParams(avail_probability=0.0), oort=oort)
    picked = sel.select(list(range(10)), 3, ctx(clients(10), oracle))
    assert len(picked) == 3
    assert oort.exploration == pytest.approx(0.9 * 0.98)  # Oort ran once


def test_ips_without_an_oracle_explains_itself():
    with pytest.raises(RuntimeError, match="availability lookahead"):
        ReflIPSSelector().select([0, 1], 1, ctx(clients(2), None))


@pytest.mark.parametrize(
    "kwargs",
    [{"time_window": 0.0}, {"avail_priority": 2}, {"avail_probability": 1.5}, {"prohibit_reselect": -1}],
)
def test_ips_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        ReflIPSParams(**kwargs)


# ---------------------------------------------------------------------------- SAA
def upd(delta: list[float], staleness: int, samples: int = 10, cid: int = 0) -> BufferedUpdate:
    u = ClientUpdate(
        num_samples=samples,
        stat_utility=1.0,
        loss=1.0,
        duration=1.0,
        delta=np.asarray(delta, dtype=np.float32),
    )
    return BufferedUpdate(
        client_id=cid, task_id=cid, base_version=0, arrived_at=0.0, update=u, staleness=staleness
    )


def test_saa_weights_by_hand():
    # fresh u1 = [1, 0], u2 = [0, 1]: n = 2, W = [1, 1], W/n = [0.5, 0.5], ||W/n||^2 = 0.5
    # stale a = [2, 2], tau 1: a/3 + W/3 - W/2 = [2/3 + 1/3 - 1/2] * 2 = [0.5, 0.5] -> 0.5 / 0.5 = r 1
    # stale b = [0.5, 0.5], tau 2: b/3 + W/3 - W/2 = [1/6 + 1/3 - 1/2] = 0 -> r 0;   max r = 1
    # w_a = 0.65 / 2 + 0.35 * (1 - e^-1 / 10) = 0.325 + 0.35 * 0.963212 = 0.662124
    # w_b = 0.65 / 3 + 0.35 * (1 - e^0 / 10)  = 0.216667 + 0.315       = 0.531667
    buf = [upd([1, 0], 0), upd([0, 1], 0), upd([2, 2], 1), upd([0.5, 0.5], 2)]
    agg = ReflSAAAggregator()
    assert np.isnan(agg.deviations(buf)[:2]).all()
    assert agg.deviations(buf)[2:] == pytest.approx([1.0, 0.0])
    w = agg.weights(buf)
    w_a = 0.325 + 0.35 * (1 - math.exp(-1) / 10)
    assert w == pytest.approx([1.0, 1.0, 0.6621242, 0.5316667])
    assert w[2] == pytest.approx(w_a)
    # normalised to 1: sum = 3.1937909
    theta = np.zeros(2, dtype=np.float32)
    new, norm_w, _ = agg.aggregate(theta, buf)
    assert norm_w == pytest.approx(w / 3.1937909)
    # step = (u1 + u2 + 0.662124 * [2, 2] + 0.531667 * [0.5, 0.5]) / 3.193791
    #      = [1 + 1.324248 + 0.265833] / 3.193791 = 2.590082 / 3.193791 = 0.810975 per coordinate
    assert new == pytest.approx([0.810975, 0.810975], rel=1e-5)


def test_saa_without_fresh_updates_orders_stale_ones_by_age_only():
    # n = 0: r/max r = 1 for all -> w = 0.65 / (tau + 1) + 0.35 * (1 - e^-1 / 10)
    buf = [upd([1, 0], 1), upd([5, 5], 3)]
    w = ReflSAAAggregator().weights(buf)
    boost = 0.35 * (1 - math.exp(-1) / 10)  # 0.337124
    assert w == pytest.approx([0.65 / 2 + boost, 0.65 / 4 + boost])  # [0.662124, 0.499624]


def test_saa_all_fresh_is_a_plain_mean_or_fedavg():
    buf = [upd([1, 0], 0, samples=1), upd([0, 1], 0, samples=3)]
    assert ReflSAAAggregator().weights(buf) == pytest.approx([1.0, 1.0])
    assert ReflSAAAggregator(ReflSAAParams(sample_weighted=True)).weights(buf) == pytest.approx([1.0, 3.0])


def test_saa_zero_fresh_mean_uses_the_numerators():
    # W = 0 (n = 2): ||W/n|| = 0; numerators ||u/3||^2: a = [3, 0] -> 1, b = [0, 6] -> 4; ratio 0.25 and 1
    buf = [upd([1, 1], 0), upd([-1, -1], 0), upd([3, 0], 1), upd([0, 6], 1)]
    assert ReflSAAAggregator().deviations(buf)[2:] == pytest.approx([0.25, 1.0])


def test_saa_single_update_weight_is_not_supported():
    with pytest.raises(TypeError):
        ReflSAAAggregator().weight(upd([1, 0], 0))


@pytest.mark.parametrize("kwargs", [{"stale_beta": 1.5}, {"scale_coff": 0.5}])
def test_saa_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        ReflSAAParams(**kwargs)


# ---------------------------------------------------------------------------- inside the orchestrator
def test_refl_star_runs_inside_the_sync_orchestrator():
    """Sync rounds, oracle knowledge, stragglers not cancelled: their late updates reach SAA stale."""
    leave = {c: (150.0 if c % 3 == 0 else 1e9) for c in range(20)}
    oracle = LeaveOracle(leave)
    selector = ReflIPSSelector(oort=OortSelector(OortParams.fedscale()))
    cfg = OrchestratorConfig(
        mode="sync", agg_goal=4, overcommit=1.3, cancel_stragglers=False, knowledge=AvailabilityName.ORACLE
    )
    orch = Orchestrator(
        cfg, np.zeros(5, np.float32), selector, ReflSAAAggregator(), np.random.default_rng(0), oracle=oracle
    )
    rng = np.random.default_rng(1)
    heap: list = []
    seq = itertools.count()
    log: list[Command] = []

    def emit(cmds: list[Command], now: float) -> None:
        for c in cmds:
            log.append(c)
            if isinstance(c, DispatchTrain):
                dur = 1.0 + 3.0 * (c.client_id % 4)  # 1, 4, 7, 10 s: some finish after the round
                u = ClientUpdate(
                    num_samples=10,
                    stat_utility=float(rng.uniform(1, 50)),
                    loss=1.0,
                    duration=dur,
                    delta=rng.standard_normal(5).astype(np.float32),
                )
                heapq.heappush(heap, (now + dur, next(seq), c.client_id, c.task_id, u))

    for cid in range(20):
        emit(orch.handle(ClientRegistered(0.0, cid, 10)), 0.0)
    while heap and orch.version < 6:
        t, _, cid, tid, u = heapq.heappop(heap)
        emit(orch.handle(TaskFinished(t, cid, tid, u)), t)

    versions = [c for c in log if isinstance(c, NewModelVersion)]
    assert len(versions) == 6
    assert any(s > 0 for v in versions for s in v.report.staleness)  # SAA saw stale updates
    for v in versions:
        assert sum(v.report.weights) == pytest.approx(1.0)
    assert all(np.isfinite(orch.weights))
