"""The run diagnostics in summary.json (staleness at aggregation, utility age at selection, time
between aggregations, the aggregator's stall time, the share of selections dropped mid-task) on
small runs whose every event can be worked out by hand: constant 10 s tasks, an always-available
trace (or one where every client leaves and returns at known times), FedBuff's buffer of K."""

from __future__ import annotations

import json

import numpy as np
import pytest

from felix.config import deep_merge
from felix.core.events import ClientRegistered
from felix.core.types import Tier
from felix.engine.setup import resolve_config
from felix.metrics.stall import StallClock
from felix.scenario.traces import DeviceTrace
from felix.sim.build import build
from felix.sim.run import run_config

BASE = {
    "model": "mlp",
    "trace": {"kind": "always"},
    "runtime": {"kind": "constant", "constant_s": 10.0},
    "run": {"target_accuracy": 0.99, "max_time_s": 1e6, "stop_at_target": False},
}


def cfg(clients: int, concurrency: int, agg_goal: int, aggregations: int, **orch: str):
    over = {
        "partition": {"num_clients": clients, "alpha": 0.5},
        "orchestrator": {"concurrency": concurrency, "agg_goal": agg_goal, **orch},
        "run": {"max_aggregations": aggregations},
    }
    return resolve_config(None, "fedbuff", deep_merge(BASE, over))


def test_a_buffer_of_three_gives_known_staleness_and_utility_age(tmp_path):
    """Three clients, three slots, K = 3. At t = 10 all three results arrive: the first two free
    their clients before the aggregation, which get new tasks on version v (utility measured this
    round: age 0); the third makes v + 1, and its client's task is on v + 1 (age 1). So every
    buffer holds two updates one version behind and one current (the first: all current), and the
    aggregations come at t = 10, 20, 30, 40: intervals of 10 s, never a stall."""
    res = run_config(cfg(3, 3, 3, 4), tmp_path, plots=False)
    d = res.summary["diagnostics"]
    staleness = [0, 0, 0] + [1, 1, 0] * 3
    ages = [0, 0, 1] * 4  # the first three selections have no utility yet
    assert res.built.orch.stats.staleness == staleness
    assert d["staleness_mean"] == pytest.approx(np.mean(staleness)) == pytest.approx(0.5)
    assert (d["staleness_p50"], d["staleness_p95"], d["staleness_max"]) == (0.5, 1.0, 1)
    assert d["selections_never_explored"] == 3
    assert d["utility_age_at_selection_mean"] == pytest.approx(np.mean(ages)) == pytest.approx(1 / 3)
    assert (d["utility_age_at_selection_p50"], d["utility_age_at_selection_p95"]) == (0.0, 1.0)
    assert (d["aggregation_interval_p50_s"], d["aggregation_interval_p95_s"]) == (10.0, 10.0)
    assert d["aggregator_stall_s"] == 0.0 and d["aggregator_stall_p95_s"] == 0.0
    assert d["train_dropped_mid_task"] == 0 and d["dropped_share"] == 0.0  # always available
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=_no_constant)


def test_one_slot_per_client_and_one_update_per_version_is_never_stale():
    """K = 1 and as many slots as results in flight at once: three results at t = 10, each its
    own version; the second is one version behind, the third two, and from then on each is two."""
    res = run_config(cfg(3, 3, 1, 12), None, plots=False)
    d = res.summary["diagnostics"]
    assert res.built.orch.stats.staleness == [0, 1, 2] + [2] * 9
    assert (d["staleness_p50"], d["staleness_mean"]) == (2.0, pytest.approx(21 / 12))
    # three versions at each of t = 10, 20, 30, 40: intervals 10, 0, 0, 10, 0, 0, ...
    assert (d["aggregation_interval_p50_s"], d["aggregation_interval_p95_s"]) == (0.0, 10.0)
    assert d["aggregator_stall_s"] == 0.0


def test_every_client_away_is_a_stall_and_a_drop():
    """Two clients, both away from t = 15 to t = 40 under TierTrack: their tasks (dispatched at
    t = 10) lose their slots at 15, so for 25 s no training task holds a slot; that stall falls in
    the interval between versions 2 (t = 10) and 3 (t = 45, the late replies)."""
    c = cfg(2, 2, 1, 6, knowledge="tiertrack")
    b = build(c)
    for dev in b.sim.devices:
        dev.trace = DeviceTrace.from_events([(0, Tier.AVL_TRAIN), (15, Tier.UN_AVL), (40, Tier.AVL_TRAIN)])
    out = b.sim.run()
    summ = b.sim.ctl.summary(out.virtual_time_s, 0.0)
    d = summ["diagnostics"]
    per = [0.0, 0.0, 25.0, 0.0, 0.0, 0.0]
    assert b.sim.ctl.stall.per_interval == per
    assert d["aggregator_stall_s"] == 25.0
    assert d["aggregator_stall_share"] == pytest.approx(25.0 / out.virtual_time_s)
    assert d["aggregator_stall_mean_s"] == pytest.approx(25.0 / 6)
    assert (d["aggregator_stall_p50_s"], d["aggregator_stall_p95_s"]) == (0.0, float(np.percentile(per, 95)))
    assert d["train_dropped_mid_task"] == 2
    assert d["dropped_share"] == pytest.approx(2 / d["train_dispatched"])
    # Without TierTrack the server cannot see them leave: no drop and no stall, one long interval.
    b = build(cfg(2, 2, 1, 6))
    for dev in b.sim.devices:
        dev.trace = DeviceTrace.from_events([(0, Tier.AVL_TRAIN), (15, Tier.UN_AVL), (40, Tier.AVL_TRAIN)])
    out = b.sim.run()
    d = b.sim.ctl.summary(out.virtual_time_s, 0.0)["diagnostics"]
    assert (d["aggregator_stall_s"], d["train_dropped_mid_task"], d["aggregation_interval_max_s"]) == (
        0.0,
        0,
        35.0,
    )


def test_waiting_for_the_first_client_is_a_stall():
    """A deployment starts before its clients register: from the start to the first dispatch no
    training task holds a slot."""
    b = build(cfg(3, 3, 3, 4))
    ctl = b.sim.ctl
    ctl.start()
    counts = tuple(b.sim.devices[0].data.class_counts(10).tolist())
    ctl.handle(ClientRegistered(5.0, 0, len(b.sim.devices[0].data), Tier.AVL_TRAIN, counts))
    assert b.orch.ledger.train_in_flight == 1  # dispatched at once
    ctl.finish(8.0)
    assert ctl.summary(8.0, 0.0)["diagnostics"]["aggregator_stall_s"] == 5.0


def test_stall_time_after_the_last_version_and_a_checkpoint():
    """The open interval counts in the total only; the clock survives ``state_dict``."""
    clock = StallClock()
    clock.observe(0.0, 0, starved=True)
    clock.observe(4.0, 1, starved=False)  # 4 s stalled, then a version
    clock.observe(6.0, 0, starved=True)
    clock.advance(9.0)  # the run ends 3 s into a stall
    again = StallClock()
    again.load_state_dict(json.loads(json.dumps(clock.state_dict(), default=list)))
    for c in (clock, again):
        assert c.per_interval == [4.0] and c.total == 7.0
        assert c.diagnostics(10.0)["aggregator_stall_share"] == 0.7
    empty = StallClock().diagnostics(0.0)
    assert empty.pop("aggregator_stall_s") == 0.0 and set(empty.values()) == {None}


def test_a_run_without_aggregations_has_null_diagnostics_not_nan(tmp_path):
    c = cfg(3, 3, 3, 1)
    res = run_config(
        c.model_copy(update={"run": c.run.model_copy(update={"max_time_s": 5.0})}), tmp_path, plots=False
    )
    d = res.summary["diagnostics"]
    assert res.summary["aggregations"] == 0
    assert d["staleness_p50"] is None and d["aggregator_stall_p50_s"] is None
    assert d["utility_age_at_selection_p50"] is None and d["aggregation_interval_p50_s"] is None
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=_no_constant)


def _no_constant(name: str) -> None:
    raise AssertionError(f"summary.json holds {name}: not strict JSON")
