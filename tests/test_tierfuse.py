"""TierFuse: weights, normalisation, cap, T_max and the server step pinned to hand-computed values."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from felix.core.commands import Command, DispatchTrain, NewModelVersion
from felix.core.events import ClientRegistered, TaskFinished
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.strategies.aggregation.tierfuse import (
    TierFuseAggregator,
    TierFuseParams,
    staleness_decay,
    utility_gain,
)
from felix.strategies.selection.random import RandomSelector


def item(
    staleness: int, utility: float = 0.0, loss: float = 0.0, delta: list[float] | None = None, cid: int = 0
) -> BufferedUpdate:
    d = np.asarray(delta if delta is not None else [0.0, 0.0, 0.0], dtype=np.float32)
    upd = ClientUpdate(num_samples=10, stat_utility=utility, loss=loss, duration=1.0, delta=d)
    return BufferedUpdate(
        client_id=cid, task_id=cid, base_version=0, arrived_at=0.0, update=upd, staleness=staleness
    )


def test_basis_functions():
    assert staleness_decay(0, 0.25) == 1.0  # 1 / 1^0.25
    assert staleness_decay(15, 0.25) == pytest.approx(0.5)  # 16^0.25 = 2
    assert staleness_decay(80, 0.25) == pytest.approx(1 / 3)  # 81^0.25 = 3
    assert utility_gain(0.0, 0.1) == pytest.approx(0.5)  # 1.5 - 1/1
    assert utility_gain(1023.0, 0.1) == pytest.approx(1.0)  # 1024^0.1 = 2 -> 1.5 - 0.5
    assert utility_gain(15.0, 0.5) == 1.0  # 1.5 - 1/16^0.5 = 1.25, capped at 1
    assert utility_gain(15.0, 0.5, cap=False) == pytest.approx(1.25)
    assert utility_gain(-3.0, 0.1) == pytest.approx(0.5)  # negative read as 0


def test_default_weights_for_a_few_staleness_utility_pairs():
    agg = TierFuseAggregator()  # sigma 0.4, a 0.25, b 0.1, L = stat_utility
    w = agg.weights([item(0, 0.0), item(15, 1023.0), item(80, 0.0)])
    # (T=0, L=0):       0.4 * 1   + 0.6 * 0.5 = 0.7
    # (T=15, L=1023):   0.4 * 0.5 + 0.6 * 1.0 = 0.8
    # (T=80, L=0):      0.4 / 3   + 0.6 * 0.5 = 0.433333
    assert w == pytest.approx([0.7, 0.8, 0.4 / 3 + 0.3])


def test_cap_on_beta_is_optional():
    it = item(0, utility=15.0)
    # beta(15) with b = 0.5 is 1.25: capped -> 0.4 + 0.6 * 1 = 1.0; uncapped -> 0.4 + 0.6 * 1.25 = 1.15
    assert TierFuseAggregator(TierFuseParams(b=0.5)).weight(it) == pytest.approx(1.0)
    assert TierFuseAggregator(TierFuseParams(b=0.5, cap_beta=False)).weight(it) == pytest.approx(1.15)


def test_utility_source_switches_between_stat_utility_and_loss():
    it = item(0, utility=1023.0, loss=0.0)
    assert TierFuseAggregator().weight(it) == pytest.approx(1.0)  # 0.4 + 0.6 * beta(1023) = 1.0
    # the paper's L = loss: beta(0) = 0.5 -> 0.4 + 0.3 = 0.7
    assert TierFuseAggregator(TierFuseParams(utility="loss")).weight(it) == pytest.approx(0.7)


def test_normalisation_by_weight_sum_or_by_count():
    buf = [item(0, 0.0, delta=[1, 0, 0], cid=1), item(15, 1023.0, delta=[0, 1, 0], cid=2)]
    theta = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    # weights 0.7 and 0.8; paper: / 1.5 -> [0.466667, 0.533333]; step = [0.466667, 0.533333, 0]
    # theta + 0.3 * step = [1 + 0.14, 2 + 0.16, 3] = [1.14, 2.16, 3.0]
    new, norm_w, _ = TierFuseAggregator().aggregate(theta, buf)
    assert norm_w == pytest.approx([0.7 / 1.5, 0.8 / 1.5])
    assert new == pytest.approx([1.14, 2.16, 3.0], rel=1e-6)
    # the authors' code: / 2 updates -> [0.35, 0.4]; theta + 0.3 * [0.35, 0.4, 0] = [1.105, 2.12, 3.0]
    new, norm_w, _ = TierFuseAggregator(normalize="count").aggregate(theta, buf)
    assert norm_w == pytest.approx([0.35, 0.4])
    assert new == pytest.approx([1.105, 2.12, 3.0], rel=1e-6)


def test_server_lr_and_norm_clipping():
    theta = np.zeros(3, dtype=np.float32)
    buf = [item(0, 0.0, delta=[3, 4, 0])]  # norm 5
    new, _, _ = TierFuseAggregator(server_lr=0.5).aggregate(theta, buf)
    assert new == pytest.approx([1.5, 2.0, 0.0])  # one update: weight 1 after normalisation; 0.5 * delta
    new, _, _ = TierFuseAggregator(server_lr=1.0, clip_norm=1.0).aggregate(theta, buf)
    assert new == pytest.approx([0.6, 0.8, 0.0])  # delta * (1 / 5)


def test_t_max_drops_older_updates():
    agg = TierFuseAggregator(TierFuseParams(t_max=2))
    buf = [item(2, 0.0, delta=[1, 0, 0], cid=1), item(3, 0.0, delta=[0, 10, 0], cid=2)]
    # T = 2 keeps 0.4 / 3^0.25 + 0.3 = 0.603950; T = 3 > 2 -> 0
    assert agg.weights(buf) == pytest.approx([0.4 / 3**0.25 + 0.3, 0.0])
    theta = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    new, norm_w, _ = agg.aggregate(theta, buf)
    assert norm_w == pytest.approx([1.0, 0.0])
    assert new == pytest.approx([1.3, 2.0, 3.0])  # only the kept update, lr 0.3
    # every update too old: the model does not move
    new, norm_w, _ = agg.aggregate(theta, [buf[1]])
    assert new == pytest.approx(theta) and norm_w == pytest.approx([0.0])


@pytest.mark.parametrize(
    "kwargs", [{"sigma": 1.2}, {"a": -1.0}, {"b": -0.1}, {"utility": "accuracy"}, {"t_max": -1}]
)
def test_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        TierFuseParams(**kwargs)


def test_aggregator_arguments_are_validated():
    with pytest.raises(ValueError):
        TierFuseAggregator(normalize="mean")
    with pytest.raises(ValueError):
        TierFuseAggregator(clip_norm=0.0)


def test_tierfuse_produces_versions_inside_the_orchestrator():
    rng = np.random.default_rng(0)
    cfg = OrchestratorConfig(mode="async", agg_goal=5, concurrency=8, knowledge=AvailabilityName.TIERTRACK)
    agg = TierFuseAggregator()
    orch = Orchestrator(cfg, np.zeros(5, np.float32), RandomSelector(), agg, np.random.default_rng(1))
    heap: list = []
    seq = itertools.count()
    log: list[Command] = []

    def emit(cmds: list[Command], now: float) -> None:
        for c in cmds:
            log.append(c)
            if isinstance(c, DispatchTrain):
                dur = 1.0 + c.client_id % 7  # slow clients come back stale
                upd = ClientUpdate(
                    num_samples=10,
                    stat_utility=float(rng.uniform(1, 500)),
                    loss=float(rng.uniform(0.1, 3)),
                    duration=dur,
                    delta=rng.standard_normal(5).astype(np.float32),
                )
                heapq.heappush(heap, (now + dur, next(seq), c.client_id, c.task_id, upd))

    for cid in range(20):
        emit(orch.handle(ClientRegistered(0.0, cid, 10)), 0.0)
    while heap and orch.version < 8:
        t, _, cid, tid, upd = heapq.heappop(heap)
        emit(orch.handle(TaskFinished(t, cid, tid, upd)), t)

    versions = [c for c in log if isinstance(c, NewModelVersion)]
    assert [v.version for v in versions] == list(range(1, 9))
    assert any(s > 0 for v in versions for s in v.report.staleness)  # stale updates were fused
    for v in versions:
        assert sum(v.report.weights) == pytest.approx(1.0)
    assert not np.allclose(orch.weights, 0.0)


def test_buffer_mean_scale_weights_utility_relative_to_the_buffer():
    # Oort-scale utilities 100, 300, 200 (mean 200) -> relative L 0.5, 1.5, 1.0; b = 1, no cap:
    # beta = 1.5 - 1/(1 + L) = 0.8333, 1.1, 1.0; w = 0.4 * 1 + 0.6 * beta at T = 0
    p = TierFuseParams(b=1.0, cap_beta=False, utility_scale="buffer_mean")
    buf = [item(0, 100.0), item(0, 300.0), item(0, 200.0)]
    assert TierFuseAggregator(p).weights(buf) == pytest.approx(
        [0.4 + 0.6 * (1.5 - 1 / 1.5), 0.4 + 0.6 * 1.1, 0.4 + 0.6 * 1.0]
    )
    # the absolute scale saturates beta at these utilities: all three weights nearly equal
    w_abs = TierFuseAggregator(TierFuseParams(b=1.0, cap_beta=False)).weights(buf)
    assert np.ptp(w_abs) < 0.01 < np.ptp(TierFuseAggregator(p).weights(buf))
    # scaling every utility by the same factor leaves the relative weights unchanged
    scaled = [item(0, 10.0 * u) for u in (100.0, 300.0, 200.0)]
    assert TierFuseAggregator(p).weights(scaled) == pytest.approx(TierFuseAggregator(p).weights(buf))


def test_buffer_mean_scale_with_no_positive_utility_reads_every_update_as_average():
    p = TierFuseParams(b=1.0, cap_beta=False, utility_scale="buffer_mean")
    assert TierFuseAggregator(p).weights([item(0, 0.0), item(0, -1.0)]) == pytest.approx([0.4 + 0.6] * 2)
    with pytest.raises(ValueError):
        TierFuseParams(utility_scale="median")  # type: ignore[arg-type]
