"""Oort selector: each formula pinned to hand-computed values, then a run inside the orchestrator."""

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
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.oort import OortParams, OortSelector, get_norm, weighted_sample
from felix.strategies.selection.sampling import choice_by_weight


def rec(
    cid: int,
    util: float | None = None,
    last: int = -1,
    dur: float | None = None,
    n: int = 100,
    updated: int = 0,
) -> ClientRecord:
    return ClientRecord(
        client_id=cid,
        num_samples=n,
        tier=Tier.AVL_TRAIN,
        reported_tier=Tier.AVL_TRAIN,
        stat_utility=util,
        last_utility_round=last,
        last_duration=dur,
        times_updated=updated,
    )


def cmap(*records: ClientRecord) -> ClientMap:
    m = ClientMap()
    for r in records:
        m.add(r)
    return m


def ctx(clients: ClientMap, round_: int = 5, seed: int = 0) -> SelectionContext:
    return SelectionContext(now=0.0, round=round_, clients=clients, rng=np.random.default_rng(seed))


# ---------------------------------------------------------------------------- get_norm
def test_get_norm_clip_min_and_range():
    v = np.array([4.0, 1.0, 3.0, 2.0, 100.0])  # sorted: [1, 2, 3, 4, 100]
    s = get_norm(v, clip_bound=0.8)
    # clip index min(int(5 * 0.8) = 4, 4) = 4 -> 100; min = 1 * 0.999; range = 100 - 0.999 = 99.001
    assert s.clip == 100.0
    assert s.min == pytest.approx(0.999)
    assert s.max == 100.0
    assert s.range == pytest.approx(99.001)
    # clip index int(5 * 0.6) = 3 -> 4: the outlier 100 is clipped to 4
    assert get_norm(v, clip_bound=0.6).clip == 4.0
    # one value: range = max(5 - 4.995, 1e-4) = 0.005; a tiny value: range floors at 1e-4
    assert get_norm(np.array([5.0]), 0.98).range == pytest.approx(0.005)
    assert get_norm(np.array([1e-6]), 0.98).range == 1e-4
    assert get_norm(np.array([]), 0.98) == (0.0, 0.0, 1e-4, 0.0)


# ---------------------------------------------------------------------------- scores
def _score_map() -> ClientMap:
    return cmap(
        rec(0, util=10.0, last=1, dur=2.0),
        rec(1, util=20.0, last=2, dur=4.0),
        rec(2, util=50.0, last=4, dur=8.0),
        rec(3, n=30),  # unexplored: registration reward min(30, cap=None) = 30
    )


def test_scores_with_clip_staleness_bonus_and_duration_penalty():
    sel = OortSelector(OortParams(round_threshold=50.0, clip_bound=0.5))
    scores = sel.score_candidates([0, 1, 2, 3], ctx(_score_map(), round_=5))
    # durations [2, 4, 8]: T = sorted[min(int(3 * 50 / 100) = 1, 2)] = 4
    assert sel.preferred_duration == 4.0
    # positive rewards incl. the unexplored one: [10, 20, 30, 50]; clip = sorted[int(4 * 0.5) = 2] = 30
    # min = 10 * 0.999 = 9.99, max = 50, range = 40.01
    # client 0: (10 - 9.99) / 40.01 = 0.00024994 + sqrt(0.1 ln 5 / 1) = 0.40117800   -> 0.40142794
    # client 1: (20 - 9.99) / 40.01 = 0.25018745 + sqrt(0.1 ln 5 / 2) = 0.28367569   -> 0.53386314
    # client 2: (min(50, 30) - 9.99) / 40.01 = 0.50012497 + sqrt(0.1 ln 5 / 4) = 0.20058900
    #           = 0.70071397, slower than T: x (4 / 8)^2 = 0.25 -> 0.17517849
    assert scores == pytest.approx({0: 0.40142794, 1: 0.53386314, 2: 0.17517849}, abs=1e-8)
    assert 3 not in scores  # unexplored clients have no exploitation score


def test_scores_without_duration_penalty():
    # round_threshold 100 -> T = inf: nobody is penalised; client 2 keeps 0.70071397
    sel = OortSelector(OortParams(round_threshold=100.0, clip_bound=0.5))
    scores = sel.score_candidates([0, 1, 2, 3], ctx(_score_map(), round_=5))
    assert sel.preferred_duration == float("inf")
    assert scores[2] == pytest.approx(0.70071397, abs=1e-8)


def test_staleness_bonus_is_zero_at_version_zero():
    # async version 0 and utilities measured at version 0: ln(max(0, 1)) = 0 -> no bonus.
    # rewards [10, 20]: min 9.99, range 10.01 -> client 0: 0.01 / 10.01, client 1: 10.01 / 10.01
    m = cmap(rec(0, util=10.0, last=0), rec(1, util=20.0, last=0))
    scores = OortSelector().score_candidates([0, 1], ctx(m, round_=0))
    assert scores == pytest.approx({0: 0.01 / 10.01, 1: 1.0})


def test_registration_reward_is_capped_by_local_steps_times_batch():
    assert OortSelector(reward_cap=32).registration_reward(rec(0, n=100)) == 32.0  # min(100, 32)
    assert OortSelector(reward_cap=32).registration_reward(rec(0, n=10)) == 10.0  # min(10, 32)
    assert OortSelector().registration_reward(rec(0, n=100)) == 100.0


# ---------------------------------------------------------------------------- pacer
def test_pacer_relaxes_then_tightens_round_threshold():
    params = OortParams(
        exploration_factor=0.0, exploration_min=0.0, pacer_step=1, pacer_delta=5.0, round_threshold=30.0
    )
    sel = OortSelector(params)
    m = cmap(
        rec(0, util=1.0, last=1),
        rec(1, util=1.0, last=1),
        *(rec(10 + i, util=1.0, last=1, dur=float(i + 1)) for i in range(20)),
    )
    c = ctx(m)
    for i in range(20):
        sel.on_update(m[10 + i], c)  # durations 1..20 known
    # T at 30: sorted[int(20 * 0.30) = 6] = 7
    assert sel.preferred_duration == 7.0
    thresholds = []
    for round_, util in enumerate([10.0, 10.0, 100.0, 50.0], start=1):
        picked = sel.select([0, 1], 2, c)  # epsilon 0: both are exploited
        assert sorted(picked) == [0, 1]
        for cid in picked:
            m[cid].stat_utility = util
            sel.on_update(m[cid], c)
        sel.on_round_end(round_, c)
        thresholds.append(sel.round_threshold)
    # per-round exploited utility = (u + u) / (2 + 1e-4):
    # r1 9.9995; r2 9.9995 -> |0| <= 0.1 * 9.9995: relax, 30 + 5 = 35
    # r3 99.995 -> |89.9955| >= 5 * 9.9995 = 49.9975: tighten, max(5, 35 - 5) = 30
    # r4 49.9975 -> |49.9975| is neither <= 9.9995 nor >= 499.975: unchanged
    assert sel.exploit_history == pytest.approx([20 / 2.0001, 20 / 2.0001, 200 / 2.0001, 100 / 2.0001])
    assert thresholds == [30.0, 35.0, 30.0, 30.0]
    # the preferred duration follows: T at 30 -> 7 again (at 35 it was sorted[7] = 8)
    assert sel.preferred_duration == 7.0


def test_pacer_threshold_moves_preferred_duration():
    sel = OortSelector(OortParams(pacer_step=1, round_threshold=30.0))
    m = cmap(*(rec(i, util=1.0, last=1, dur=float(i + 1)) for i in range(20)))
    c = ctx(m)
    for r in m:
        sel.on_update(r, c)
    sel.on_round_end(1, c)
    sel.on_round_end(2, c)  # two flat (zero) rounds: relax to 35
    assert sel.round_threshold == 35.0
    assert sel.preferred_duration == 8.0  # sorted[int(20 * 0.35) = 7] = 8


# ---------------------------------------------------------------------------- exploration
def _mixed_map(n_explored: int = 20, n_unexplored: int = 20) -> ClientMap:
    rng = np.random.default_rng(7)
    return cmap(
        *(rec(i, util=float(rng.uniform(1, 100)), last=int(rng.integers(1, 5))) for i in range(n_explored)),
        *(rec(n_explored + i, n=int(rng.integers(5, 200))) for i in range(n_unexplored)),
    )


def test_exploration_decays_to_its_floor():
    sel = OortSelector(OortParams(exploration_factor=0.9, exploration_decay=0.5, exploration_min=0.2))
    m = _mixed_map()
    seen = []
    for seed in range(4):
        sel.select(list(range(40)), 10, ctx(m, seed=seed))
        seen.append(sel.exploration)
    # 0.9 * 0.5 = 0.45, 0.225, max(0.1125, 0.2) = 0.2, 0.2
    assert seen == pytest.approx([0.45, 0.225, 0.2, 0.2])


def test_exploration_drops_to_zero_once_everyone_is_explored_oort_only():
    m = _mixed_map(n_explored=10, n_unexplored=0)
    oort = OortSelector()
    oort.select(list(range(10)), 3, ctx(m))
    assert oort.exploration == 0.0
    fedscale = OortSelector(OortParams.fedscale())
    fedscale.select(list(range(10)), 3, ctx(m))
    assert fedscale.exploration == pytest.approx(0.9 * 0.98)


@pytest.mark.parametrize("variant, exploited", [("oort", 7), ("fedscale", 8)])
def test_exploit_explore_split_per_variant(variant, exploited):
    # epsilon stays 0.25; K = 10: oort int(10 * 0.75) = 7, fedscale 10 - int(2.5) = 8 exploited
    params = OortParams(exploration_factor=0.25, exploration_decay=1.0, exploration_min=0.25, variant=variant)
    m = _mixed_map()
    picked = OortSelector(params).select(list(range(40)), 10, ctx(m))
    assert sum(m[c].explored for c in picked) == exploited
    assert len(picked) == 10


def test_stochastic_rounding_exploits_single_slot_top_ups():
    # K = 1, epsilon 0.2: floor gives int(0.8) = 0 exploits (never); stochastic exploits ~80%
    m = _mixed_map()
    floor = OortParams(exploration_factor=0.2, exploration_min=0.2)
    floor_picks = [OortSelector(floor).select(list(range(40)), 1, ctx(m, seed=s))[0] for s in range(50)]
    assert not any(m[c].explored for c in floor_picks)
    stoch = OortParams(exploration_factor=0.2, exploration_min=0.2, rounding="stochastic")
    stoch_picks = [OortSelector(stoch).select(list(range(40)), 1, ctx(m, seed=s))[0] for s in range(200)]
    hits = sum(m[c].explored for c in stoch_picks)
    assert 140 <= hits <= 180


def test_exploration_samples_inside_the_reward_window():
    # epsilon 1: everything explores; K = 1, sample_window 2 -> only the int(2 * 1) = 2 largest
    # registration rewards (clients 3 and 4, 40 and 50 samples) can be drawn
    m = cmap(*(rec(i, n=10 * (i + 1)) for i in range(5)))
    params = OortParams(exploration_factor=1.0, exploration_min=1.0, sample_window=2.0)
    picks = {OortSelector(params).select(list(range(5)), 1, ctx(m, seed=s))[0] for s in range(40)}
    assert picks == {3, 4}


# ---------------------------------------------------------------------------- cut-off
def _ranked_map() -> ClientMap:
    # equal staleness and no durations: scores rise with utility, client 4 best
    return cmap(*(rec(i, util=10.0 * (i + 1), last=1) for i in range(5)))


def test_cut_off_keeps_only_clients_near_the_exploit_len_th_score():
    # K = 1, epsilon 0 -> exploitLen 1; cut = 1.0 x score at 0-based rank 1 (second best), so only
    # the two best clients pass and are sampled by score
    params = OortParams(exploration_factor=0.0, exploration_min=0.0, cut_off_util=1.0)
    picks = {OortSelector(params).select(list(range(5)), 1, ctx(_ranked_map(), seed=s))[0] for s in range(60)}
    assert picks == {3, 4}


def test_fedscale_cut_off_keeps_ten_times_exploit_len():
    # FedScale keeps going past the cut until it holds more than 10 x 1 clients: all 5 are eligible
    params = OortParams(exploration_factor=0.0, exploration_min=0.0, cut_off_util=1.0, variant="fedscale")
    picks = {
        OortSelector(params).select(list(range(5)), 1, ctx(_ranked_map(), seed=s))[0] for s in range(200)
    }
    assert picks == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------------------- sampling contract
def test_sampling_is_reproducible_and_returns_k_distinct_candidates():
    m = _mixed_map(15, 15)
    candidates = list(range(2, 30, 1))[:20]
    runs = [OortSelector(OortParams.felix_authors()).select(candidates, 8, ctx(m, seed=3)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 8 and len(set(runs[0])) == 8
    assert set(runs[0]) <= set(candidates)
    assert OortSelector().select(candidates, 0, ctx(m)) == []
    assert sorted(OortSelector().select([4, 20], 2, ctx(m))) == [4, 20]


def test_blacklist_excludes_the_most_updated_clients_up_to_its_cap():
    m = cmap(
        rec(0, util=50.0, last=1, updated=5),
        rec(1, util=40.0, last=1, updated=3),
        rec(2, util=1.0, last=1),
        rec(3, util=1.0, last=1),
    )
    base = {"exploration_factor": 0.0, "exploration_min": 0.0, "blacklist_rounds": 2}
    # counts 5 and 3 exceed 2; cap int(0.5 * 4) = 2 -> both out
    picked = OortSelector(OortParams(**base, blacklist_max_len=0.5)).select([0, 1, 2, 3], 2, ctx(m))
    assert sorted(picked) == [2, 3]
    # cap int(0.25 * 4) = 1 -> only the most updated (client 0) is out
    for seed in range(10):
        sel = OortSelector(OortParams(**base, blacklist_max_len=0.25))
        picked = sel.select([0, 1, 2, 3], 2, ctx(m, seed=seed))
        assert 0 not in picked and len(picked) == 2


def test_weighted_sample_takes_positive_weights_first():
    rng = np.random.default_rng(0)
    idx = weighted_sample(np.array([0.0, 5.0, 0.0, -1.0]), 2, rng)
    assert 1 in idx and len(set(idx.tolist())) == 2


def test_choice_by_weight_draws_exactly_as_numpy_choice():
    """The exploit / explore sampler replays ``Generator.choice(replace=False, p=...)``: the same
    picks in the same order, and the generator left in the same state."""
    g = np.random.default_rng(123)
    for trial in range(1000):
        m = int(g.integers(1, 200))
        w = [g.random(m), g.lognormal(0.0, 3.0, m), np.round(3 * g.random(m)), np.ones(m)][trial % 4]
        positive = int(np.count_nonzero(w))
        if positive == 0:
            continue
        n = int(g.integers(1, positive + 1))
        p = w / w.sum()
        seed = int(g.integers(2**31))
        ours, numpy_rng = np.random.default_rng(seed), np.random.default_rng(seed)
        assert choice_by_weight(p, n, ours).tolist() == numpy_rng.choice(m, n, replace=False, p=p).tolist()
        assert ours.random() == numpy_rng.random()
    with pytest.raises(ValueError):  # fewer positive weights than picks: numpy's own error
        choice_by_weight(np.array([1.0, 0.0]), 2, g)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exploration_factor": 1.5},
        {"exploration_decay": 0.0},
        {"round_threshold": 0.0},
        {"round_threshold": 101.0},
        {"clip_bound": 0.0},
        {"cut_off_util": 1.5},
        {"sample_window": 0.5},
        {"pacer_step": 0},
        {"pacer_delta": 0.0},
        {"blacklist_rounds": -1},
        {"variant": "kuiper"},
        {"rounding": "round"},
    ],
)
def test_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        OortParams(**kwargs)


def test_reward_cap_is_validated():
    with pytest.raises(ValueError):
        OortSelector(reward_cap=0)


# ---------------------------------------------------------------------------- inside the orchestrator
def drive(
    orch: Orchestrator, tiers: list[Tier] | None = None, versions: int = 6, seed: int = 0
) -> list[Command]:
    """A tiny fake shell: 20 clients; training takes 1-5 s and returns a random float32 delta of
    the 5-element model; eval tasks take 0.05 s and return a utility only."""
    rng = np.random.default_rng(seed)
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
                    num_samples=10 + c.client_id,
                    stat_utility=float(rng.uniform(1, 50)),
                    loss=float(rng.uniform(0.1, 3.0)),
                    duration=dur,
                    delta=rng.standard_normal(5).astype(np.float32) if train else None,
                )
                heapq.heappush(heap, (now + dur, next(seq), c.client_id, c.task_id, upd))

    for cid in range(20):
        emit(orch.handle(ClientRegistered(0.0, cid, 10 + cid, tiers[cid] if tiers else Tier.AVL_TRAIN)), 0.0)
    while heap and orch.version < versions:
        t, _, cid, tid, upd = heapq.heappop(heap)
        emit(orch.handle(TaskFinished(t, cid, tid, upd)), t)
    return log


def test_oort_selects_inside_the_async_orchestrator():
    sel = OortSelector(OortParams.felix_authors())
    cfg = OrchestratorConfig(mode="async", agg_goal=4, concurrency=6, knowledge=AvailabilityName.TIERTRACK)
    orch = Orchestrator(cfg, np.zeros(5, np.float32), sel, FedBuffAggregator(), np.random.default_rng(1))
    log = drive(orch)
    assert orch.version == 6
    trains = [c for c in log if isinstance(c, DispatchTrain)]
    assert len(trains) >= 4 * 6  # every aggregated update came from its own training task
    assert {c.client_id for c in trains} <= set(range(20))
    assert len(sel.exploit_history) == 6  # the pacer saw every aggregation
    assert sel.exploration < 0.9  # decayed once per selection
    assert len([c for c in log if isinstance(c, NewModelVersion)]) == 6


def test_oort_selects_inside_the_sync_orchestrator():
    sel = OortSelector(OortParams())
    cfg = OrchestratorConfig(mode="sync", agg_goal=4, overcommit=1.3, knowledge=AvailabilityName.NONE)
    orch = Orchestrator(cfg, np.zeros(5, np.float32), sel, FedBuffAggregator(), np.random.default_rng(2))
    drive(orch, versions=5)
    assert orch.version == 5
    assert any(orch.clients[c].explored for c in range(20))
    assert all(np.isfinite(orch.weights))
