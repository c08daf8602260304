"""Secure aggregation in the simulator: off, a run is exactly as without the section; on, every
aggregation goes through SecAgg+ groups (the same protocol objects), the summary reports them, the
protocol's bytes are counted, and the run is reproducible although every mask is fresh randomness
(the unmasked sums are exact integers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.setup import resolve_config
from felix.secagg.aggregate import SecureSum
from felix.secagg.config import LinkCfg, SecureAggregationCfg
from felix.secagg.latency import group_seconds
from felix.secagg.session import StageTraffic
from felix.sim.run import run_config

TINY: dict[str, Any] = {
    "partition": {"num_clients": 12},
    "model": "mlp",
    "trace": {"kind": "always"},
    "run": {"max_aggregations": 4, "target_accuracy": 0.3, "target_window": 1, "stop_at_target": False},
    "orchestrator": {"concurrency": 6, "agg_goal": 6},
}


def _run(tmp: Path, name: str, strategy: str, extra: dict[str, Any]) -> tuple[dict[str, Any], str]:
    cfg = resolve_config(None, strategy, {**TINY, **extra})
    run_config(cfg, tmp / name, plots=False)
    return json.loads((tmp / name / "summary.json").read_text()), (tmp / name / "evaluations.csv").read_text()


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "provenance")}


def test_secure_aggregation_none_runs_exactly_as_without_the_section(tmp_path: Path) -> None:
    absent, absent_csv = _run(tmp_path, "absent", "fedbuff", {})
    none, none_csv = _run(
        tmp_path, "none", "fedbuff", {"secure_aggregation": {"protocol": "none", "group_size": 3}}
    )
    assert "secure_aggregation" not in absent and "secure_aggregation" not in none
    assert _comparable(absent) == _comparable(none)
    assert absent_csv == none_csv


def test_a_buffered_run_sums_by_groups_counts_their_bytes_and_is_reproducible(tmp_path: Path) -> None:
    plain, _ = _run(tmp_path, "plain", "fedbuff", {})
    sa = {"secure_aggregation": {"protocol": "buffered", "group_size": 3}}
    one, one_csv = _run(tmp_path, "one", "fedbuff", sa)
    _, two_csv = _run(tmp_path, "two", "fedbuff", sa)
    s = one["secure_aggregation"]
    assert s["protocol"] == "buffered"
    assert s["groups"] == 4 * 2 and s["groups_abandoned"] == 0 and s["updates_lost"] == 0
    assert s["bytes_overhead"] > 0
    total = one["bytes_up"] + one["bytes_down"] - plain["bytes_up"] - plain["bytes_down"]
    assert total == s["bytes_overhead"]
    assert one_csv == two_csv  # fresh masks every run, the same exact sums
    assert abs(one["final_accuracy"] - plain["final_accuracy"]) < 0.05  # only quantisation differs


def test_a_sync_round_with_secagg_plus_reaches_the_same_accuracy(tmp_path: Path) -> None:
    sync = {"orchestrator": {"mode": "sync", "agg_goal": 6}, "aggregator": {"name": "fedavg"}}
    plain, _ = _run(tmp_path, "plain", "fedavg", sync)
    on, _ = _run(
        tmp_path, "on", "fedavg", {**sync, "secure_aggregation": {"protocol": "secagg_plus", "group_size": 8}}
    )
    s = on["secure_aggregation"]
    # 8 dispatched a round (overcommit 1.3), 6 report, 2 are cancelled after sharing: one group
    assert s["groups"] == 4 and s["dropouts_recovered"] == 4 * 2 and s["updates_lost"] == 0
    assert abs(on["final_accuracy"] - plain["final_accuracy"]) < 0.05


class _Stats:
    train_dropped = 0
    train_cancelled = 0


class _Orch:
    def __init__(self) -> None:
        self.stats = _Stats()
        self.version = 3
        from felix.core.types import Tier

        self.clients = {c: type("Rec", (), {"reported_tier": Tier.AVL_TRAIN})() for c in range(20)}


def _buffer(deltas: list[np.ndarray]) -> list[BufferedUpdate]:
    return [
        BufferedUpdate(i, 100 + i, 0, 0.0, ClientUpdate(10 * (i + 1), 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
        for i, d in enumerate(deltas)
    ]


def test_the_secure_step_is_the_weighted_mean_to_quantisation_and_dropped_tasks_are_recovered() -> None:
    rng = np.random.default_rng(3)
    deltas = [rng.normal(0, 0.1, 50) for _ in range(9)]
    buf = _buffer(deltas)
    w = np.array([float(b.update.num_samples) for b in buf])
    orch = _Orch()
    cfg = SecureAggregationCfg(protocol="buffered", group_size=5)
    mech = SecureSum(cfg, "weights", orch, np.random.default_rng(0))
    orch.stats.train_dropped = 2  # two tasks of this aggregation lost their slots after sharing
    step, norm_w = mech.noised_step(buf, w)
    want = sum(wi * d for wi, d in zip(w, deltas)) / w.sum()
    assert np.abs(step - want).max() < 1e-4
    assert np.allclose(norm_w, w / w.sum())
    s = mech.summary()
    assert s["groups"] == 3 and s["dropouts_recovered"] == 2 and s["groups_abandoned"] == 0


# ---------------------------------------------------------------------- with central DP
def _with_dp(sigma: float, clip: float, k: int) -> tuple[SecureSum, Any]:
    from felix.privacy.central import CentralGaussian

    dp = CentralGaussian(sigma, clip, k, np.random.default_rng(11))
    orch = _Orch()
    mech = SecureSum(
        SecureAggregationCfg(protocol="buffered", group_size=10), "count", orch, np.random.default_rng(0), dp
    )
    return mech, dp


def test_with_central_dp_the_clients_clip_and_the_server_noises_the_unmasked_sum() -> None:
    n = 4000
    mech, dp = _with_dp(sigma=2.0, clip=0.5, k=4)
    step, norm_w = mech.noised_step(_buffer([np.zeros(n) for _ in range(4)]), np.ones(4))
    expected = 2.0 * 0.5 / 4
    assert abs(float(np.std(step)) - expected) < 5 * expected / np.sqrt(2 * (n - 1))
    assert np.allclose(norm_w, 0.25)
    mech, dp = _with_dp(sigma=1e-9, clip=0.5, k=3)
    big = [np.full(n, 0.1), np.full(n, 0.1), np.zeros(n)]  # norm 6.3, clipped by the clients to 0.5
    step, _ = mech.noised_step(_buffer(big), np.ones(3))
    assert float(np.linalg.norm(step * 3)) == pytest.approx(1.0, rel=1e-3)
    assert dp.max_contribution_norm == pytest.approx(0.5)


def test_with_central_dp_a_clients_second_update_in_one_aggregation_is_left_out() -> None:
    mech, _ = _with_dp(sigma=1e-9, clip=10.0, k=3)
    buf = _buffer([np.full(8, 0.1), np.full(8, 0.2), np.full(8, 0.4)])
    buf[1] = BufferedUpdate(0, 201, 0, 0.0, buf[1].update, 1)  # client 0 again (a late reply)
    step, norm_w = mech.noised_step(buf, np.ones(3))
    assert norm_w[0] == 0 and mech.summary()["updates_lost"] == 1
    assert np.allclose(step, (0.2 + 0.4) / 3, atol=1e-4)


def test_a_run_with_secure_aggregation_and_central_dp_reports_both(tmp_path: Path) -> None:
    pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] (dp-accounting) not installed")
    extra = {
        "aggregator": {"normalize": "count"},
        "privacy": {"mechanism": "central_gaussian", "noise_multiplier": 0.5, "clip_norm": 1.0},
        "secure_aggregation": {"protocol": "buffered", "group_size": 6},
    }
    on, _ = _run(tmp_path, "both", "fedbuff", extra)
    assert on["privacy"]["aggregations"] == 4 and on["privacy"]["epsilon"] > 0
    assert on["privacy"]["max_contribution_norm"] <= 1.0 + 1e-9
    assert on["secure_aggregation"]["groups"] == 4 and on["secure_aggregation"]["groups_abandoned"] == 0


@pytest.mark.parametrize("normalize", ["weights", "count"])
def test_weights_below_one_keep_the_secure_step_within_quantisation_of_the_plaintext(normalize: str) -> None:
    """FedBuff's and TierFuse's weights are at most 1: folded over a fixed scale of 1,000 they would
    shrink w * delta below the quantisation step (a 40% error on FeLiX's steps); the default scale is
    the aggregation's largest weight."""
    rng = np.random.default_rng(5)
    deltas = [rng.normal(0, 0.01, 5000) for _ in range(10)]
    w = rng.uniform(0.6, 1.0, 10)
    mech = SecureSum(
        SecureAggregationCfg(protocol="buffered", group_size=16), normalize, _Orch(), np.random.default_rng(0)
    )
    step, norm_w = mech.noised_step(_buffer(deltas), w)
    denom = w.sum() if normalize == "weights" else len(w)
    plain = sum(wi * d for wi, d in zip(w, deltas)) / denom
    assert np.linalg.norm(step - plain) / np.linalg.norm(plain) < 1e-3
    assert np.allclose(norm_w, w / denom, rtol=1e-5)


# ---------------------------------------------------------------------- the exchanges' virtual time
def _exchange(
    stage: str, down: dict[int, int], up: dict[int, int], silent: tuple[int, ...] = ()
) -> StageTraffic:
    return StageTraffic(stage, down, up, list(silent))


def test_an_exchange_lasts_its_slowest_members_round_trip_or_the_deadline_for_a_silent_one() -> None:
    link = LinkCfg(rtt_s=0.1, down_mbps=8.0, up_mbps=1.0)
    keys = _exchange("keys", {1: 1000, 2: 1000, 3: 1000}, {1: 100, 2: 100, 3: 125_000})  # member 3: 1 Mbit up
    assert group_seconds([keys], link, 10.0).seconds == pytest.approx(0.1 + 0.001 + 1.0)
    masked = _exchange("masked", {1: 500, 2: 500}, {1: 1000, 2: 1000})
    # the plaintext update's bytes are the task's, not the protocol's
    assert group_seconds([masked], link, 10.0, excused={1: 1000, 2: 1000}).seconds == pytest.approx(
        0.1 + 0.0005
    )
    unmask = _exchange("unmask", {1: 80, 2: 80, 4: 80}, {1: 50, 2: 50}, silent=(4,))
    took = group_seconds([keys, unmask], link, 10.0)
    assert took.seconds == pytest.approx(1.101 + 10.0) and took.deadlines == 1
    enough = _exchange("unmask", {1: 80, 2: 80, 4: 80}, {1: 50, 2: 50}, silent=(4,))
    enough.sufficient = True  # the answers in suffice: the server waits the grace, not the deadline
    took = group_seconds([keys, enough], link, 10.0, grace_s=2.0)
    assert took.seconds == pytest.approx(1.101 + 0.1 + 80e-6 + 400e-6 + 2.0) and took.deadlines == 0
    assert group_seconds([enough], link, 1.5, grace_s=2.0).seconds == 1.5  # the deadline comes first
    gone = group_seconds([keys, unmask], link, 10.0, gone={4})  # a member the server itself let go
    assert gone.seconds == pytest.approx(1.101 + 0.1 + 80e-6 + 400e-6) and gone.deadlines == 0


def test_a_silent_member_holds_the_aggregation_a_grace_past_the_answers_only_while_they_suffice() -> None:
    """The deployment's rule: a member silent at the unmask request costs that exchange the grace
    (the answers in suffice), a cancelled one nothing, and a group that cannot finish the deadline."""
    from felix.core.types import Tier

    rng = np.random.default_rng(4)
    buf = _buffer([rng.normal(0, 0.1, 50) for _ in range(6)])
    w = np.ones(6)
    cfg = SecureAggregationCfg(protocol="buffered", group_size=8, stage_timeout_s=7.0, stage_grace_s=2.0)
    orch = _Orch()
    mech = SecureSum(cfg, "weights", orch, np.random.default_rng(0))
    orch.stats.train_dropped = 2  # two tasks the server itself let go after they shared
    mech.noised_step(buf, w)
    fast = mech.take_delay()
    assert 4 * cfg.link.rtt_s < fast < 1.0 and mech.deadlines == 0 and mech.dropouts_recovered == 2
    assert mech.take_delay() == 0.0  # taken once
    orch.clients[buf[0].client_id].reported_tier = Tier.UN_AVL  # it will not answer the unmask request
    mech.noised_step(buf, w)
    slow = mech.take_delay()
    assert slow == pytest.approx(fast + 2.0, abs=0.01) and mech.deadlines == 0
    for b in buf[1:4]:  # 4 of 8 silent at the unmask request, threshold 5: the group cannot finish
        orch.clients[b.client_id].reported_tier = Tier.UN_AVL
    with pytest.raises(ValueError, match="abandoned"):
        mech.noised_step(buf, w)
    stuck = mech.take_delay()
    assert 7.0 + 3 * cfg.link.rtt_s < stuck < 8.0 and mech.deadlines == 1
    assert mech.summary()["delay_s"] == pytest.approx(fast + slow + stuck)


def test_a_sync_run_holds_each_new_version_back_by_its_groups_exchanges(tmp_path: Path) -> None:
    """Each round starts when the previous version is released, so the last evaluation moves by
    the sum of the delays, against the same rounds without secure aggregation (no delay at all);
    a shell that only stamped the evaluations later would move it by the last delay alone, one
    that ignored the delays not at all."""
    sync = {"orchestrator": {"mode": "sync", "agg_goal": 6}, "aggregator": {"name": "fedavg"}}
    _, plain_csv = _run(tmp_path, "plain", "fedavg", sync)
    runs = {}
    for name, rtt in (("quick", 0.001), ("slow", 2.0)):
        link = {"rtt_s": rtt, "down_mbps": 100.0, "up_mbps": 100.0}
        sa = {"protocol": "secagg_plus", "group_size": 8, "link": link}
        runs[name] = _run(tmp_path, name, "fedavg", {**sync, "secure_aggregation": sa})
    (quick, quick_csv), (slow, slow_csv) = runs["quick"], runs["slow"]
    dq, ds = quick["secure_aggregation"]["delay_s"], slow["secure_aggregation"]["delay_s"]
    assert ds > dq + 4 * 4 * 1.9  # four rounds of four exchanges
    assert plain_csv.splitlines()[0].split(",")[0] == "time_s"
    last = [float(c.splitlines()[-1].split(",")[0]) for c in (plain_csv, quick_csv, slow_csv)]
    assert last[1] - last[0] == pytest.approx(dq, abs=1e-3)
    assert last[2] - last[0] == pytest.approx(ds, abs=1e-3)


# ---------------------------------------------------------------------- an aggregation abandoned whole
class _SilentBeforeMasking:
    """A deployment's groups (``SecureSum.remote``) in which all but two members go silent before
    sending their masked vectors: with threshold 3, every group is abandoned."""

    def __init__(self, deltas: dict[int, np.ndarray]) -> None:
        self.deltas = deltas
        self.bytes = 0

    def run_group(self, layout: Any, q: Any, weights: Any, length: int, client_of: Any) -> Any:
        from felix.secagg.session import run_group

        updates = {m: (weights[m], self.deltas[m]) for m in layout.members}
        server, traffic = run_group(layout, q, updates, {m: "masked" for m in layout.members[2:]})
        self.bytes += traffic.total
        return server, traffic


def test_an_abandoned_aggregation_counts_its_updates_lost_once_and_no_negative_overhead() -> None:
    """The orchestrator's fallback retries each update of a failed aggregation alone: those
    retries must not count the updates lost again; and the overhead of a group abandoned before
    its masked vectors has no plaintext update to subtract (none was sent)."""
    from felix.core.buffer import AggregationBuffer
    from felix.strategies.aggregation.fedavg import FedBuffAggregator

    rng = np.random.default_rng(5)
    buf = _buffer([rng.normal(0, 0.1, 2000) for _ in range(5)])
    mech = SecureSum(SecureAggregationCfg(protocol="buffered", group_size=5), "weights", _Orch(), rng)
    remote = _SilentBeforeMasking({b.task_id: b.update.delta for b in buf})
    mech.remote = remote
    agg = FedBuffAggregator()
    agg.privacy = mech
    buffer = AggregationBuffer()
    for b in buf:
        buffer.add(b)
    theta = np.zeros(2000, np.float32)
    with pytest.raises(ValueError, match="every group of this aggregation was abandoned"):
        buffer.aggregate(agg, theta, 0)
    assert len(buffer.drop_unaggregatable(agg, theta)) == 5  # as the orchestrator does: each alone
    s = mech.summary()
    assert (s["groups"], s["groups_abandoned"], s["updates_lost"]) == (1, 1, 5)
    # two masked vectors stood in for two plaintext updates; the three others were never sent
    assert s["bytes_overhead"] == remote.bytes - 2 * 4 * 2000 > 0
