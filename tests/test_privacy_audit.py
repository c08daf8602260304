"""A canary audit of the mechanisms (a simple privacy audit, as in Jagielski et al. 2020 and
Nasr et al. 2021): a canary client whose update is a known direction u takes part in an
aggregation or not; an attacker who knows every other update projects what is released on u and
thresholds it. Over many runs, any test's false-positive rate FPR and true-positive rate TPR obey
TPR <= e^eps FPR + delta (and the mirror image) at the accounted (eps, delta), so the empirical
epsilon, log((TPR - delta) / FPR) with 95% Clopper-Pearson bounds on both rates, must stay below
the accounted one. The audit has power: the same attack on a mechanism that adds a tenth of the
accounted noise finds an epsilon above the accounted one."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from felix.core.types import BufferedUpdate, ClientUpdate
from felix.privacy.accountant import Accountant
from felix.privacy.banded import sqrt_coefficients, toeplitz
from felix.privacy.central import CentralGaussian
from felix.privacy.ftrl import BandedAggregation, TreeAggregation
from felix.privacy.local import LocalMechanism
from felix.strategies.aggregation.fedavg import FedBuffAggregator

RUNS, D, C, K, DELTA = 3000, 64, 1.0, 4, 1e-5


def empirical_epsilon(with_canary: np.ndarray, without: np.ndarray) -> float:
    """The largest epsilon a threshold on the projections proves at 95% confidence (Clopper-Pearson
    lower bound on TPR, upper bound on FPR), over 400 thresholds spread by quantile."""
    from scipy.stats import beta

    t = np.quantile(np.concatenate([with_canary, without]), np.linspace(0.0, 1.0, 401))
    n1, n0 = len(with_canary), len(without)
    hits = (with_canary[None, :] >= t[:, None]).sum(axis=1)
    false = (without[None, :] >= t[:, None]).sum(axis=1)
    tpr_lo = np.where(hits > 0, beta.ppf(0.025, np.maximum(hits, 1), n1 - hits + 1), 0.0)
    fpr_hi = np.where(false < n0, beta.ppf(0.975, false + 1, np.maximum(n0 - false, 1)), 1.0)
    ok = tpr_lo > DELTA
    if not ok.any():
        return 0.0
    return float(max(0.0, np.max(np.log((tpr_lo[ok] - DELTA) / fpr_hi[ok]))))


def _direction() -> np.ndarray:
    u = np.random.default_rng(0).normal(size=D)
    return u / np.linalg.norm(u)


def _server_projections(mechanism: Callable[[int], object], canary: bool) -> np.ndarray:
    """The released step, less the known others' contributions, projected on u (in units of C / K)."""
    u, rng = _direction(), np.random.default_rng(1 if canary else 2)
    out = np.empty(RUNS)
    for i in range(RUNS):
        others = [rng.normal(size=D) * 0.1 for _ in range(K - 1)]
        deltas = [*others, 10 * u] if canary else others  # the canary's update is far beyond the clip
        buffer = [
            BufferedUpdate(cid, cid, 0, 0.0, ClientUpdate(1, 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
            for cid, d in enumerate(deltas)
        ]
        agg = FedBuffAggregator(normalize="count")
        agg.privacy = mechanism(i)  # type: ignore[assignment]
        step, _, _ = agg.aggregate(np.zeros(D, dtype=np.float32), buffer)
        known = sum(np.asarray(o, dtype=np.float32).astype(np.float64) for o in others)
        out[i] = float(np.dot(step.astype(np.float64) * K - known, u))
    return out


@pytest.mark.parametrize("kind", ["central_gaussian", "dp_ftrl"])
def test_the_canary_is_no_more_distinguishable_than_the_accounted_epsilon(kind: str) -> None:
    pytest.importorskip("dp_accounting")
    sigma = 1.0
    accounted = Accountant(kind, sigma, DELTA, max_participations=1).epsilon_after(1)
    cls = CentralGaussian if kind == "central_gaussian" else TreeAggregation

    def honest(i: int) -> object:
        return cls(sigma, C, K, np.random.default_rng(10_000 + i))

    def broken(i: int) -> object:  # adds a tenth of the noise it is accounted for
        return cls(sigma / 10, C, K, np.random.default_rng(10_000 + i))

    found = empirical_epsilon(_server_projections(honest, True), _server_projections(honest, False))
    assert 0.5 < found < accounted  # the attack sees the canary, within what epsilon allows
    leaky = empirical_epsilon(_server_projections(broken, True), _server_projections(broken, False))
    assert leaky > accounted


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_a_local_report_hides_its_direction_within_the_accounted_epsilon(noise: str) -> None:
    """Local DP: the device's report of +C u against that of -C u (any two updates: the clip
    ball's diameter 2C is the sensitivity the accountant uses)."""
    pytest.importorskip("dp_accounting")
    sigma = 2.0
    accounted = Accountant("local", sigma, DELTA, max_participations=1, noise=noise).epsilon_after(1)
    u = _direction() if noise == "gaussian" else np.eye(D)[0]  # L1 clip: a coordinate direction

    def reports(sign: float, noise_scale: float, seed: int) -> np.ndarray:
        mech = LocalMechanism(noise_scale, C, noise, max_participations=RUNS, seed=seed)
        upd = ClientUpdate(1, 0.0, 0.0, 1.0, (sign * 5 * u).astype(np.float32))
        return np.array([float(np.dot(mech.release(0, i, upd).delta, u)) for i in range(RUNS)])

    found = empirical_epsilon(reports(1.0, sigma, 1), reports(-1.0, sigma, 2))
    assert 0.3 < found < accounted
    leaky = empirical_epsilon(reports(1.0, sigma / 10, 1), reports(-1.0, sigma / 10, 2))
    assert leaky > accounted


def _banded_statistics(sigma: float, canary: bool, steps: int, bands: int) -> np.ndarray:
    """``steps`` aggregations of ``banded_mf``, the canary in the first alone; the attacker knows
    the others, so sees the increments' noise w = C^-1 z plus the canary's contribution: it undoes
    the correlation (C y = C x + z, independent noise) and matches C's first column, the
    likelihood-ratio test of the canary (in units of C)."""
    u, rng = _direction(), np.random.default_rng(3 if canary else 4)
    col = toeplitz(sqrt_coefficients(bands), steps)
    out = np.empty(RUNS)
    for i in range(RUNS):
        agg = FedBuffAggregator(normalize="count")
        agg.privacy = BandedAggregation(sigma, C, K, bands, np.random.default_rng(20_000 + i))
        y = np.empty(steps)
        for t in range(steps):
            others = [rng.normal(size=D) * 0.1 for _ in range(K - 1)]
            deltas = [*others, 10 * u] if canary and t == 0 else others
            buffer = [
                BufferedUpdate(cid, cid, 0, 0.0, ClientUpdate(1, 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
                for cid, d in enumerate(deltas)
            ]
            step, _, _ = agg.aggregate(np.zeros(D, dtype=np.float32), buffer)
            known = sum(np.asarray(o, dtype=np.float32).astype(np.float64) for o in others)
            y[t] = float(np.dot(step.astype(np.float64) * K - known, u))
        out[i] = float(np.dot(col[:, 0], col @ y))
    return out


def test_the_banded_canary_is_no_more_distinguishable_than_the_accounted_epsilon() -> None:
    """The correlated noise of four aggregations, two bands: the attack that undoes the
    correlation proves no more than the epsilon of the separated sensitivity, and a mechanism
    with a tenth of the noise leaks more."""
    pytest.importorskip("dp_accounting")
    sigma, steps, bands = 1.0, 4, 2
    accounted = Accountant("banded_mf", sigma, DELTA, max_participations=1, bands=bands).epsilon_after(steps)
    found = empirical_epsilon(
        _banded_statistics(sigma, True, steps, bands), _banded_statistics(sigma, False, steps, bands)
    )
    assert 0.5 < found < accounted
    leaky = empirical_epsilon(
        _banded_statistics(sigma / 10, True, steps, bands),
        _banded_statistics(sigma / 10, False, steps, bands),
    )
    assert leaky > accounted
