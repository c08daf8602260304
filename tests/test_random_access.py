"""The Random Access Model: draws, probability generators, rarity coupling, trace conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from felix.core.types import Tier
from felix.metrics.per_client import rare_client_mask
from felix.scenario.random_access import (
    RandomAccessModel,
    beta_probabilities,
    correlate_with_rarity,
    participation_to_events,
    rarity_scores,
    two_level_probabilities,
)
from felix.scenario.traces import DeviceTrace


def test_ram_validates_and_is_immutable() -> None:
    for bad in ([], [[0.5]], [0.5, 1.5], [-0.1], [float("nan")]):
        with pytest.raises(ValueError, match="RAM probabilities"):
            RandomAccessModel(np.array(bad, dtype=float))
    src = np.array([0.2, 0.4])
    ram = RandomAccessModel(src)
    src[0] = 0.9
    assert ram.probabilities[0] == 0.2  # copied at construction
    with pytest.raises(ValueError):
        ram.probabilities[0] = 0.3


def test_ram_draw_frequencies_and_determinism() -> None:
    p = np.array([0.0, 0.05, 0.5, 1.0])
    ram = RandomAccessModel(p)
    draws = ram.draw_rounds(20000, np.random.default_rng(1))
    assert draws.shape == (20000, 4) and draws.dtype == np.bool_
    np.testing.assert_allclose(draws.mean(axis=0), p, atol=0.01)
    assert np.array_equal(draws, ram.draw_rounds(20000, np.random.default_rng(1)))
    assert not np.array_equal(draws, ram.draw_rounds(20000, np.random.default_rng(2)))
    assert np.array_equal(ram.draw(np.random.default_rng(1)), draws[0])


def test_two_level_probabilities() -> None:
    p = two_level_probabilities(100, np.random.default_rng(0))
    assert (p == 0.5).sum() == 20 and (p == 0.05).sum() == 80
    assert p.sum() == pytest.approx(14.0)  # 20 * 0.5 + 80 * 0.05 expected participants
    assert np.array_equal(p, two_level_probabilities(100, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="p_rare <= p_frequent"):
        two_level_probabilities(10, np.random.default_rng(0), p_frequent=0.1, p_rare=0.2)


def test_beta_probabilities_are_skewed_and_clipped() -> None:
    p = beta_probabilities(2000, np.random.default_rng(0))
    assert p.min() >= 0.02 and p.max() <= 0.9
    assert np.median(p) < p.mean()  # long right tail: many rare, a few frequent
    assert np.array_equal(p, beta_probabilities(2000, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="p_min"):
        beta_probabilities(5, np.random.default_rng(0), p_min=0.0)


def test_rarity_scores_hand_values() -> None:
    # global counts [14, 1] of 15: pi = [14/15, 1/15]; surprisal [log(15/14), log 15]
    counts = np.array([[9, 0], [0, 1], [5, 0], [0, 0]])
    s = rarity_scores(counts)
    np.testing.assert_allclose(s, [math.log(15 / 14), math.log(15), math.log(15 / 14), 0.0])


def test_correlate_gives_the_rarest_clients_the_lowest_probabilities() -> None:
    counts = np.array([[9, 0], [0, 1], [5, 0]])
    # rarest first: client 1, then the tie 0, 2 in index order -> p sorted [0.05, 0.2, 0.5]
    out = correlate_with_rarity(np.array([0.5, 0.05, 0.2]), counts)
    np.testing.assert_allclose(out, [0.2, 0.05, 0.5])
    rng = np.random.default_rng(3)
    big = rng.integers(0, 50, size=(60, 10)) * (rng.random((60, 10)) < 0.3)
    big[:, 0] += 1
    p = correlate_with_rarity(beta_probabilities(60, rng), big)
    score = rarity_scores(big)
    ranks_p, ranks_s = (np.argsort(np.argsort(a)) for a in (p, score))
    assert np.corrcoef(ranks_p, ranks_s)[0, 1] < -0.95  # Spearman
    with pytest.raises(ValueError, match="3 probabilities for 60 clients"):
        correlate_with_rarity(np.array([0.1, 0.2, 0.3]), big)


def test_participation_to_events_format() -> None:
    part = np.array([[True, False, False], [True, True, False], [False, True, False]])
    ev = participation_to_events(part, slot_s=60.0)
    assert ev == {
        0: [(0.0, "AVL_TRAIN"), (120.0, "UN_AVL")],
        1: [(0.0, "UN_AVL"), (60.0, "AVL_TRAIN"), (180.0, "UN_AVL")],
        2: [(0.0, "UN_AVL")],
    }
    with pytest.raises(ValueError, match="boolean"):
        participation_to_events(part.astype(int), 60.0)
    with pytest.raises(ValueError, match="slot_s"):
        participation_to_events(part, 0.0)


def test_events_read_back_by_the_trace_reader() -> None:
    ram = RandomAccessModel(np.array([0.1, 0.5, 0.9]))
    part = ram.draw_rounds(30, np.random.default_rng(4))
    for cid, evs in participation_to_events(part, slot_s=10.0).items():
        trace = DeviceTrace.from_events([(t, Tier.parse(s)) for t, s in evs])
        tiers = [trace.tier_at(r * 10.0 + 5.0) is Tier.AVL_TRAIN for r in range(30)]
        assert tiers == list(part[:, cid])
        assert trace.tier_at(300.0) is Tier.UN_AVL


def test_rare_clients_by_rank_survive_ties() -> None:
    """80% frequent at 0.3 and 20% rare at 0.03: quantile(p, 0.25) is 0.3, so ``p <= quantile``
    would call every client rare; the rank rule and the explicit threshold do not."""
    p = np.array([0.3] * 16 + [0.03] * 4)[np.random.default_rng(0).permutation(20)]
    assert (p <= np.quantile(p, 0.25)).all()  # the old definition's failure
    by_rank = rare_client_mask(p)
    assert by_rank.sum() == 5  # ceil(20 / 4): the four rare clients and the lowest-index frequent one
    assert (p[by_rank] == 0.03).sum() == 4 and np.flatnonzero(by_rank & (p == 0.3))[0] == np.flatnonzero(
        p == 0.3
    )[0]
    np.testing.assert_array_equal(rare_client_mask(p, threshold=0.03), p == 0.03)
    q = np.array([0.5, 0.1, 0.2, 0.05, 0.9, 0.3, 0.01, 0.4])
    np.testing.assert_array_equal(np.flatnonzero(rare_client_mask(q)), [3, 6])
    with pytest.raises(ValueError, match="no client has p <= 0.001"):
        rare_client_mask(q, threshold=0.001)
    with pytest.raises(ValueError, match="fraction"):
        rare_client_mask(q, fraction=0.0)
