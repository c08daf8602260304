"""Population-scale selection: the columnar ClientMap, the vectorised selectors and their state.

The selections must be those of the per-record selectors this project had before (recorded in
``data/selection_fixture.json`` by ``selection_scenarios.py``), and a selector rebuilt from its
``state_dict`` must go on selecting exactly as the original would have.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from selection_scenarios import SCENARIOS, SEEDS, _build, run_scenario

from felix.core.client_map import _LOG_SIZE, ClientMap, ClientRecord
from felix.core.commands import UpdateRejected
from felix.core.events import ClientRegistered
from felix.core.orchestrator import Orchestrator, OrchestratorConfig
from felix.core.selection import SelectionContext
from felix.core.types import Tier
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.oort import OortParams, OortSelector
from felix.strategies.selection.random import RandomSelector
from felix.strategies.selection.ranking import kth_largest, largest_first, smallest_first
from felix.strategies.selection.refl import ReflIPSSelector
from felix.strategies.selection.tierselect import TierSelectEval

FIXTURE = json.loads((Path(__file__).parent / "data" / "selection_fixture.json").read_text())
CASES = [f"{name}/{seed}" for name in SCENARIOS for seed in SEEDS]


def _same_log(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["kinds"] == want["kinds"]
    assert got["clients"] == want["clients"]
    for key in ("version", "train_dispatched", "eval_dispatched"):
        assert got[key] == want[key], key
    assert len(got["states"]) == len(want["states"])
    for (v1, s1), (v2, s2) in zip(got["states"], want["states"], strict=True):
        assert v1 == v2
        assert s1.keys() == s2.keys()
        for key in s1:
            if key == "exploited" and s1[key] is not None:
                # the pacer's sum is math.fsum now (order-free); the old one summed a set in hash order
                assert s1[key] == pytest.approx(s2[key], rel=1e-12, abs=1e-12), (v1, key)
            else:
                assert s1[key] == s2[key], (v1, key)


# ---------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("case", CASES)
def test_selections_match_the_recorded_per_record_selectors(case):
    name, seed = case.split("/")
    _same_log(run_scenario(name, int(seed)), FIXTURE[case])


# ---------------------------------------------------------------------------- state round trips
def _through_npz(state: dict[str, Any]) -> dict[str, Any]:
    """A state as it comes back from a file: every value a numpy array (0-d for numbers)."""
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf) as f:
        return {k: f[k] for k in f.files}


def _plain(state: dict[str, Any]) -> bool:
    return all(isinstance(v, (np.ndarray, int, float)) and not isinstance(v, bool) for v in state.values())


def _swap_at(name: str, at: set[int]):
    """A hook that, at the given event counts, restores the ClientMap from its own ``state_dict`` (in
    place: its ``load_state_dict`` replaces every attribute by a fresh map's, and the ledger keeps
    writing its ``in_flight`` column) and replaces both selectors by fresh instances restored from
    the originals' (all through an npz round trip)."""

    def hook(orch: Orchestrator, handled: int) -> Orchestrator:
        if handled not in at:
            return orch
        cmap_state = orch.clients.state_dict()
        sel_state = orch.selector.state_dict()
        ev_state = orch.eval_selector.state_dict() if hasattr(orch.eval_selector, "state_dict") else {}
        assert _plain(cmap_state) and _plain(sel_state) and _plain(ev_state)
        _, train, ev = _build(name, orch.oracle)
        orch.clients.load_state_dict(_through_npz(cmap_state))
        train.load_state_dict(_through_npz(sel_state))
        if ev is not None:
            ev.load_state_dict(ev_state)
            orch.eval_selector = ev
        orch.selector = train
        return orch

    return hook


@pytest.mark.parametrize(
    "case",
    [
        "felix-async/0",
        "oort-async-oracle/1",
        "oort-sync-none/0",
        "fedscale-blacklist/1",
        "refl-oort/0",
        "refl-random/1",
        "random-async/0",
    ],
)
def test_restored_state_selects_exactly_as_the_original(case):
    name, seed = case.split("/")
    _same_log(run_scenario(name, int(seed), hook=_swap_at(name, {150, 400, 700})), FIXTURE[case])


def test_oort_state_is_proportional_to_the_population():
    m = ClientMap()
    for c in range(500):
        m.add(
            ClientRecord(
                c,
                10,
                Tier.AVL_TRAIN,
                Tier.AVL_TRAIN,
                stat_utility=float(c % 7) or None,
                last_utility_round=c % 5,
                last_duration=float(c % 11) or None,
            )
        )
    sel = OortSelector(OortParams(blacklist_rounds=0))
    sel.select(np.arange(0, 500, 2), 10, SelectionContext(0.0, 5, m, np.random.default_rng(0)))
    state = sel.state_dict()
    assert _plain(state)
    assert {state[k].size for k in ("seen_duration", "seen_explored", "watched")} == {500}
    assert state["exploit_pending"].size <= 10
    twin = OortSelector(OortParams(blacklist_rounds=0))
    twin.load_state_dict(state)
    assert twin.preferred_duration == sel.preferred_duration
    assert twin.exploration == sel.exploration
    picks = [
        s.select(np.arange(1, 500, 3), 12, SelectionContext(0.0, 6, m, np.random.default_rng(4)))
        for s in (sel, twin)
    ]
    assert picks[0] == picks[1]


@pytest.mark.parametrize(
    "bad",
    [
        {"exploration": "x"},
        {"exploration": float("nan")},
        {"seen_explored": np.zeros(3, bool)},
        {"exploit_history": np.array([np.inf])},
        {"watched": np.zeros((2, 2), bool)},
        {"extra": 1},
    ],
)
def test_oort_state_is_validated(bad):
    sel = OortSelector()
    state = {
        **OortSelector().state_dict(),
        "seen_duration": np.full(4, np.nan),
        "seen_explored": np.zeros(4, bool),
        "watched": np.zeros(4, bool),
    }
    sel.load_state_dict(state)  # the well-formed one loads
    with pytest.raises(ValueError):
        sel.load_state_dict({**state, **bad})


def test_stateless_selectors_refuse_state():
    assert TierSelectEval(3).state_dict() == {} and ReflIPSSelector().state_dict() == {}
    with pytest.raises(ValueError):
        TierSelectEval(3).load_state_dict({"x": np.zeros(1)})
    with pytest.raises(ValueError):
        ReflIPSSelector().load_state_dict({"oort/exploration": 0.5})
    with pytest.raises(ValueError):
        ReflIPSSelector(oort=OortSelector()).load_state_dict({"exploration": 0.5})


# ---------------------------------------------------------------------------- the ClientMap
class ReferenceMap:
    """The old dict-of-records semantics, to check the columnar map against."""

    def __init__(self) -> None:
        self.tier: dict[int, Tier] = {}
        self.busy: set[int] = set()

    def idle_in(self, *tiers: Tier) -> list[int]:
        return sorted(c for c, t in self.tier.items() if t in tiers and c not in self.busy)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_client_map_pools_follow_a_random_history(seed):
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.permutation(300)] + [10**12, 2**40 + 1, 70_000]  # unordered, some far away
    if seed == 2:
        ids = sorted(ids)  # the simulator's case: ids registered in order
    m, ref = ClientMap(capacity=4), ReferenceMap()
    for step in range(3000):
        op = rng.random()
        if op < 0.1 and len(ref.tier) < len(ids):
            cid = ids[len(ref.tier)]
            tier = Tier(int(rng.integers(3)))
            m.add(ClientRecord(cid, 5, tier, tier, class_counts=(cid % 3, 1)))
            ref.tier[cid] = tier
        elif ref.tier:
            cid = list(ref.tier)[int(rng.integers(len(ref.tier)))]
            if op < 0.6:
                tier = Tier(int(rng.integers(3)))
                assert m.set_tier(cid, tier) is ref.tier[cid]
                ref.tier[cid] = tier
            else:
                busy = rng.random() < 0.5
                m.set_in_flight(cid, step if busy else None)
                (ref.busy.add if busy else ref.busy.discard)(cid)
        if step % 97 == 0:
            for tiers in ((Tier.AVL_TRAIN,), (Tier.AVL_TRAIN, Tier.AVL_EVAL), tuple(Tier)):
                assert m.idle_in(*tiers).tolist() == ref.idle_in(*tiers)
    assert len(m) == len(ref.tier)
    for cid, tier in ref.tier.items():
        assert m[cid].tier is tier and m[cid].client_id == cid
        assert (m[cid].in_flight is not None) == (cid in ref.busy)
    copy = ClientMap()
    copy.load_state_dict(_through_npz(m.state_dict()))
    for tiers in ((Tier.AVL_TRAIN,), (Tier.AVL_EVAL, Tier.UN_AVL)):
        assert copy.idle_in(*tiers).tolist() == ref.idle_in(*tiers)
    assert [r.class_counts for r in copy] == [r.class_counts for r in m]
    assert copy.rows_of(list(ref.tier)).tolist() == m.rows_of(list(ref.tier)).tolist()


def test_client_view_reads_and_writes_the_columns():
    m = ClientMap()
    m.add(ClientRecord(7, 40, Tier.AVL_EVAL, Tier.AVL_TRAIN, last_duration=3.5, times_updated=2))
    r = m[7]
    assert (r.stat_utility, r.explored, r.last_duration, r.in_flight) == (None, False, 3.5, None)
    r.stat_utility = 1.25
    r.times_dropped += 1
    r.tier = Tier.AVL_TRAIN
    m.set_in_flight(7, 12)  # the column's writer (an orchestrator's ledger); views only read it
    assert m[7].explored and m[7].stat_utility == 1.25 and m[7].times_dropped == 1
    assert m.column("stat_utility").tolist() == [1.25] and m.column("times_updated").tolist() == [2]
    assert m.idle_in(Tier.AVL_TRAIN).tolist() == [] and m[7].in_flight == 12
    m.set_in_flight(7, None)
    assert m.idle_in(Tier.AVL_TRAIN).tolist() == [7] and m.idle_in(Tier.AVL_EVAL).tolist() == []


def test_client_map_rejects_bad_input():
    m = ClientMap()
    m.add(ClientRecord(1, 1, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    with pytest.raises(ValueError, match="already registered"):
        m.add(ClientRecord(1, 1, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    with pytest.raises(ValueError, match="64-bit"):
        m.add(ClientRecord(2**64, 1, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    with pytest.raises(KeyError):
        m.rows_of([1, 5])
    with pytest.raises(KeyError):
        m[-3]
    assert 1 in m and 5 not in m and "1" not in m
    state = m.state_dict()
    for bad in (
        {**state, "tier": np.array([7])},
        {**state, "client_id": np.array([1, 2])},
        {k: v for k, v in state.items() if k != "tier"},
        {**state, "class_counts_len": np.array([3])},
    ):
        with pytest.raises(ValueError):
            ClientMap().load_state_dict(bad)


# ---------------------------------------------------------------------------- the write log
def test_write_log_names_the_rows_whose_result_fields_were_written():
    m = ClientMap()
    for c in range(10):
        m.add(ClientRecord(c, 5, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    assert m.written_since(None) is None  # no mark: read the whole map
    m.add(ClientRecord(10, 5, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    mark = m.mark()
    assert m.written_since(mark).tolist() == []
    m.add(ClientRecord(11, 5, Tier.AVL_TRAIN, Tier.AVL_TRAIN, stat_utility=2.0))  # registered with a history
    m[3].stat_utility = 1.0
    m[7].last_duration = 2.0
    m[3].times_updated += 1
    m[5].times_selected += 1  # not a result field
    m.set_in_flight(5, 9)
    m[5].tier = Tier.UN_AVL
    assert m.written_since(mark).tolist() == [11, 3, 7, 3]
    copy = ClientMap()
    copy.load_state_dict(m.state_dict())
    assert copy.written_since(mark) is None  # another map's mark
    assert copy.written_since(copy.mark()).tolist() == []
    m.load_state_dict(m.state_dict())
    assert m.written_since(mark) is None  # a restored state is read afresh


def test_write_log_matches_a_reference_across_wraps():
    rng = np.random.default_rng(0)
    m = ClientMap()
    for c in range(50):
        m.add(ClientRecord(c, 5, Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    written: list[int] = []
    marks = [(m.mark(), 0)]
    for step in range(3 * _LOG_SIZE):
        r = int(rng.integers(50))
        view = m[r]
        if step % 3 == 0:
            view.stat_utility = float(step)
        elif step % 3 == 1:
            view.last_duration = None
        else:
            view.times_updated += 1
        written.append(r)
        if rng.random() < 0.01:
            marks.append((m.mark(), len(written)))
        if step % 509 == 0 or step == 3 * _LOG_SIZE - 1:
            for mark, at in marks:
                got = m.written_since(mark)
                if len(written) - at > _LOG_SIZE:
                    assert got is None
                else:
                    assert got is not None and got.tolist() == written[at:]


@pytest.mark.parametrize("blacklist", [None, 2])
def test_oort_keeps_up_from_the_log_as_a_full_read_would(blacklist):
    """The population-wide state the selector keeps from the write log (explored count, sorted
    durations, blacklist watch) equals what a fresh selector builds by reading the whole map,
    through single writes, a burst past the re-sort threshold and one past the log's size."""
    rng = np.random.default_rng(5)
    n = 400
    m = ClientMap()
    for c in range(n):
        m.add(ClientRecord(c, int(rng.integers(1, 50)), Tier.AVL_TRAIN, Tier.AVL_TRAIN))
    sel = OortSelector(OortParams(blacklist_rounds=blacklist))
    for step in range(40):
        writes = {10: 600, 20: _LOG_SIZE + 10}.get(step, int(rng.integers(0, 12)))
        for _ in range(writes):
            view = m[int(rng.integers(n))]
            view.stat_utility = float(rng.uniform(1, 9))
            view.last_duration = float(rng.integers(1, 40))
            view.times_updated += 1
        ctx = SelectionContext(0.0, step + 1, m, np.random.default_rng(step))
        sel.select(np.flatnonzero(rng.random(n) < 0.3), 5, ctx)
        fresh = OortSelector(OortParams(blacklist_rounds=blacklist))
        fresh.score_candidates([0], ctx)
        mine, full = sel.state_dict(), fresh.state_dict()
        for key in ("seen_duration", "seen_explored", "watched"):
            assert np.array_equal(mine[key], full[key], equal_nan=True), (step, key)
        assert mine["seen_explored"].sum() == (~np.isnan(m.column("stat_utility"))).sum()
        assert sel.preferred_duration == fresh.preferred_duration


# ---------------------------------------------------------------------------- ranking
def test_ranking_matches_stable_sorts():
    rng = np.random.default_rng(3)
    for trial in range(400):
        n = int(rng.integers(1, 9000))
        v = [rng.random(n), rng.integers(0, 4, n).astype(float), np.sort(rng.random(n))][trial % 3]
        m = int(rng.integers(0, min(n, 100) + 1)) if trial % 2 else int(rng.integers(0, n + 1))
        assert largest_first(v, m).tolist() == np.argsort(-v, kind="stable")[:m].tolist()
        assert smallest_first(v, m).tolist() == np.argsort(v, kind="stable")[:m].tolist()
        k = int(rng.integers(0, n))
        assert kth_largest(v, k) == np.sort(v)[::-1][k]


def test_registration_beyond_64_bits_is_rejected_not_fatal():
    orch = Orchestrator(
        OrchestratorConfig(),
        np.zeros(2, np.float32),
        RandomSelector(),
        FedBuffAggregator(),
        np.random.default_rng(0),
    )
    for ev in (ClientRegistered(0.0, 2**70, 5), ClientRegistered(0.0, 3, 2**64)):
        out = orch.handle(ev)
        assert [type(c) for c in out] == [UpdateRejected] and len(orch.clients) == 0
