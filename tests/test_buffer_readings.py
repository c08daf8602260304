"""Each preset's reading of the buffered update, pinned on one hand-made buffer.

The presets name which published arithmetic they follow (docs/felix.md, "Which reading each
preset is"): published FedBuff divides the staleness-weighted sum by the buffer size K; the sync
strategies take FedAvg's sample-weighted mean; ``felix`` is the paper's text (TierFuse over the sum
of its weights, beta capped); ``felix-authors`` is the authors' runs (TierFuse over K, beta
uncapped); ``oort-async*-equal-step`` is FedBuff's weights over their sum.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from felix.core.aggregation import AGGREGATORS
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.components import run_facts
from felix.engine.setup import resolve_config

THETA = np.array([1.0, 2.0, 3.0], dtype=np.float32)


def buffer() -> list[BufferedUpdate]:
    """Three updates: (staleness, samples, utility, delta) = (0, 10, 0, e1), (3, 30, 1023, e2), (8, 60, 0, e3)."""
    rows = [(0, 10, 0.0, [1.0, 0.0, 0.0]), (3, 30, 1023.0, [0.0, 1.0, 0.0]), (8, 60, 0.0, [0.0, 0.0, 1.0])]
    out = []
    for cid, (t, n, u, d) in enumerate(rows):
        upd = ClientUpdate(
            num_samples=n, stat_utility=u, loss=0.0, duration=1.0, delta=np.asarray(d, dtype=np.float32)
        )
        out.append(
            BufferedUpdate(
                client_id=cid, task_id=cid, base_version=0, arrived_at=0.0, update=upd, staleness=t
            )
        )
    return out


def new_model(preset: str) -> np.ndarray:
    cfg = resolve_config(None, preset, {})
    agg = AGGREGATORS.create(cfg.aggregator.name, cfg.aggregator.params, run_facts(cfg))
    new, _, _ = agg.aggregate(THETA, buffer())
    return new


FEDBUFF_W = [1.0, 1.0 / math.sqrt(4.0), 1.0 / math.sqrt(9.0)]  # 1/sqrt(1+T): 1, 0.5, 1/3


def tierfuse_w() -> list[float]:
    """0.4 / (1+T)^0.25 + 0.6 beta(L), beta(L) = 1.5 - 1/(1+L)^0.1: 0.5 at L = 0 and exactly 1 at
    L = 1023 (1024^0.1 = 2), so the cap does not bind here (the uncapped case is tested below)."""
    beta = [0.5, 1.0, 0.5]
    return [0.4 / (1.0 + t) ** 0.25 + 0.6 * b for t, b in zip((0, 3, 8), beta)]


@pytest.mark.parametrize(
    "preset", ["fedbuff", "oort-async", "oort-async*", "oort-async+tiertrack", "felix-no-tierfuse"]
)
def test_published_fedbuff_divides_by_the_buffer_size(preset: str) -> None:
    lr = resolve_config(None, preset, {}).aggregator.server_lr
    expected = THETA + lr * np.array(FEDBUFF_W) / 3.0
    assert new_model(preset) == pytest.approx(expected, rel=1e-6)


def test_the_equal_step_control_divides_by_the_sum_of_the_weights() -> None:
    expected = THETA + 0.3 * np.array(FEDBUFF_W) / sum(FEDBUFF_W)
    assert new_model("oort-async*-equal-step") == pytest.approx(expected, rel=1e-6)
    # A weighted mean of the deltas: the step is server_lr x (weights summing to 1), as felix's.
    assert float((new_model("oort-async*-equal-step") - THETA).sum()) == pytest.approx(0.3, rel=1e-6)


@pytest.mark.parametrize("preset", ["oort", "oort*", "fedavg"])
def test_sync_strategies_take_the_sample_weighted_mean(preset: str) -> None:
    expected = THETA + np.array([10.0, 30.0, 60.0]) / 100.0
    assert new_model(preset) == pytest.approx(expected, rel=1e-6)


def test_felix_is_the_papers_text() -> None:
    w = tierfuse_w()
    expected = THETA + 0.3 * np.array(w) / sum(w)
    assert new_model("felix") == pytest.approx(expected, rel=1e-6)


def test_felix_authors_divides_tierfuse_by_the_buffer_size_with_beta_uncapped() -> None:
    w = tierfuse_w()
    expected = THETA + 0.3 * np.array(w) / 3.0
    assert new_model("felix-authors") == pytest.approx(expected, rel=1e-6)
    # Uncapped beta: at L = 1e6, beta = 1.5 - 1/(1e6+1)^0.1 = about 1.25 instead of 1.
    buf = buffer()
    buf[1].update.stat_utility = 1e6
    cfg = resolve_config(None, "felix-authors", {})
    agg = AGGREGATORS.create("tierfuse", cfg.aggregator.params, run_facts(cfg))
    beta = 1.5 - 1.0 / (1e6 + 1.0) ** 0.1
    assert beta > 1.2
    assert agg.weights(buf)[1] == pytest.approx(0.4 / 4**0.25 + 0.6 * beta)
    paper = resolve_config(None, "felix", {})
    capped = AGGREGATORS.create("tierfuse", paper.aggregator.params, run_facts(paper))
    assert capped.weights(buf)[1] == pytest.approx(0.4 / 4**0.25 + 0.6)


def test_under_the_buffer_size_tierfuse_steps_further_than_fedbuff() -> None:
    """The confound the equal-step control removes: at the same server lr and buffer size,
    TierFuse's larger mean weight is a larger server step."""
    step_authors = float((new_model("felix-authors") - THETA).sum())
    step_fedbuff = float((new_model("oort-async*") - THETA).sum())
    assert step_authors / step_fedbuff == pytest.approx(sum(tierfuse_w()) / sum(FEDBUFF_W), rel=1e-6)
    assert step_authors / step_fedbuff > 1.1  # 2.11 / 1.83 here; about 1.7 at the runs' staleness
