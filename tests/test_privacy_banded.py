"""Banded matrix-factorisation DP-FTRL (``privacy.mechanism: banded_mf``, felix.privacy.banded):
the factorisation against dense matrices, the streamed noise against B z, the sensitivity against
a brute force, the noise std against theory, the separation rule in the orchestrator, resumed
noise, a private run end to end and its refusals."""

from __future__ import annotations

import json
import math
from itertools import combinations, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from privacy_support import dp, tiny

from felix.config import ConfigError, validate
from felix.core.separation import Separation
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.setup import resolve_config
from felix.privacy.accountant import Accountant
from felix.privacy.banded import (
    BandedNoise,
    inverse_coefficients,
    prefix_coefficients,
    sensitivity,
    sqrt_coefficients,
    toeplitz,
)
from felix.privacy.budget import PrivacyBudget
from felix.privacy.central import CentralGaussian
from felix.privacy.ftrl import BandedAggregation
from felix.sim.run import run_config
from felix.strategies.aggregation.fedavg import FedBuffAggregator

TINY: dict[str, Any] = tiny(6)


def _prefix(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n)))


def _banded(bands: int, n: int) -> np.ndarray:
    return toeplitz(sqrt_coefficients(bands), n)


def _buffer(deltas: list[np.ndarray]) -> list[BufferedUpdate]:
    return [
        BufferedUpdate(i, i, 0, 0.0, ClientUpdate(60, 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
        for i, d in enumerate(deltas)
    ]


# ---------------------------------------------------------------------- the factorisation
def test_the_untruncated_toeplitz_root_squared_is_the_prefix_sum_matrix() -> None:
    assert sqrt_coefficients(4).tolist() == [1.0, 0.5, 0.375, 0.3125]
    for n in (1, 5, 40):
        c = toeplitz(sqrt_coefficients(n), n)
        assert np.abs(c @ c - _prefix(n)).max() < 1e-12


@pytest.mark.parametrize("bands", [1, 2, 3, 8, 30])
@pytest.mark.parametrize("n", [1, 7, 30, 64])
def test_b_times_c_is_the_prefix_sum_matrix(bands: int, n: int) -> None:
    c = _banded(bands, n)
    assert np.all(np.tril(c, -bands) == 0)  # banded: C[i, j] = 0 for i - j >= b
    b = toeplitz(prefix_coefficients(sqrt_coefficients(bands), n), n)
    assert np.abs(b @ c - _prefix(n)).max() < 1e-12
    assert (
        np.abs(toeplitz(inverse_coefficients(sqrt_coefficients(bands), n), n) @ c - np.eye(n)).max() < 1e-12
    )


@pytest.mark.parametrize("bands", [1, 2, 5, 12])
def test_the_streamed_noise_is_b_z_for_a_fixed_seed(bands: int) -> None:
    n, size = 12, 7
    z = np.random.default_rng(4).normal(0.0, 0.3, (n, size))  # drawn row by row, as the stream draws
    stream = BandedNoise(size, 0.3, bands, np.random.default_rng(4))
    released = np.cumsum([stream.advance() for _ in range(n)], axis=0)  # the noise of each prefix sum
    b = toeplitz(prefix_coefficients(sqrt_coefficients(bands), n), n)
    assert np.abs(released - b @ z).max() < 1e-12
    assert len(stream._past) == min(bands - 1, n)  # it holds the last b - 1 draws, no more


# ---------------------------------------------------------------------- sensitivity
def _brute_sensitivity(steps: int, bands: int, cap: int, *, separated: bool = True) -> float:
    """The largest ||C u|| over every set of at most ``cap`` aggregations (``bands`` apart if
    ``separated``) and every sign of the client's unit contribution in each."""
    c = _banded(bands, steps)
    best = 0.0
    for m in range(1, cap + 1):
        for picked in combinations(range(steps), m):
            if separated and any(b - a < bands for a, b in pairwise(picked)):
                continue
            for signs in np.array(np.meshgrid(*[[-1.0, 1.0]] * m)).reshape(m, -1).T:
                best = max(best, float(np.linalg.norm(c[:, list(picked)] @ signs)))
    return best


@pytest.mark.parametrize(("steps", "bands"), [(1, 1), (4, 1), (6, 2), (7, 3), (8, 4), (5, 8)])
def test_the_sensitivity_equals_the_brute_force_over_separated_participations(steps: int, bands: int) -> None:
    for cap in (1, 2, 3):
        assert sensitivity(steps, bands, cap) == pytest.approx(
            _brute_sensitivity(steps, bands, cap), rel=1e-12
        )
    assert sensitivity(steps, bands, None) == pytest.approx(
        _brute_sensitivity(steps, bands, steps), rel=1e-12
    )


def test_without_the_separation_a_client_reaches_a_larger_sensitivity() -> None:
    """The rule is what makes the bound hold: two contributions one aggregation apart overlap."""
    assert _brute_sensitivity(6, 3, 2, separated=False) > sensitivity(6, 3, 2) * 1.1


# ---------------------------------------------------------------------- the mechanism's noise
def test_the_noise_of_an_increment_and_of_a_prefix_sum_match_theory() -> None:
    """Zero updates: aggregation t moves the model by w_t / K, whose std is sigma C ||row t of
    C^-1|| / K; the model after t aggregations carries sigma C ||row t of B|| / K."""
    sigma, c, k, n, steps, bands = 0.8, 0.5, 4, 100_000, 6, 3
    agg = FedBuffAggregator(normalize="count")
    agg.privacy = BandedAggregation(sigma, c, k, bands, np.random.default_rng(2))
    inv = toeplitz(inverse_coefficients(sqrt_coefficients(bands), steps), steps)
    b = toeplitz(prefix_coefficients(sqrt_coefficients(bands), steps), steps)
    theta = np.zeros(n, dtype=np.float32)
    for t in range(steps):
        new, _, _ = agg.aggregate(theta, _buffer([np.zeros(n)]))
        for got, row in ((new - theta, inv[t]), (new, b[t])):
            expected = sigma * c * float(np.linalg.norm(row)) / k
            assert abs(float(np.std(got, ddof=1)) - expected) < 5 * expected / math.sqrt(2 * (n - 1))
        theta = new
    # the correlation is real: the model's noise after 6 steps is well below 6 independent draws'
    assert np.linalg.norm(b[-1]) < 0.8 * math.sqrt(steps)


def test_one_band_is_the_central_gaussian_mechanism() -> None:
    """b = 1: C = I, the same noise on every aggregation as central_gaussian from the same seed,
    and the same epsilon without a cap."""
    deltas = [np.random.default_rng(i).normal(size=50) for i in range(3)]
    banded, central = FedBuffAggregator(normalize="count"), FedBuffAggregator(normalize="count")
    banded.privacy = BandedAggregation(1.5, 0.7, 3, 1, np.random.default_rng(9))
    central.privacy = CentralGaussian(1.5, 0.7, 3, np.random.default_rng(9))
    theta = np.zeros(50, dtype=np.float32)
    for _ in range(4):
        one, _, _ = banded.aggregate(theta, _buffer(deltas))
        other, _, _ = central.aggregate(theta, _buffer(deltas))
        assert np.array_equal(one, other)
        theta = one
    dp()
    for steps in (1, 10, 100):
        assert Accountant("banded_mf", 3.0, 1e-5, bands=1).epsilon_after(steps) == pytest.approx(
            Accountant("central_gaussian", 3.0, 1e-5).epsilon_after(steps), rel=1e-9
        )


def test_a_restored_mechanism_continues_the_same_noise() -> None:
    def fresh() -> FedBuffAggregator:
        agg = FedBuffAggregator(normalize="count")
        agg.privacy = BandedAggregation(1.0, 1.0, 2, 4, np.random.default_rng(5))
        return agg

    theta = np.zeros(30, dtype=np.float32)
    whole, steps = fresh(), []
    for i in range(7):
        if i == 3:
            saved = whole.privacy.state_dict()  # type: ignore[union-attr]
        steps.append(whole.aggregate(theta, _buffer([np.ones(30)]))[0])
    resumed = fresh()
    resumed.privacy.load_state_dict(saved)  # type: ignore[union-attr]
    again = [resumed.aggregate(theta, _buffer([np.ones(30)]))[0] for _ in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(again, steps[3:], strict=True))
    assert len(saved["noise"]["past"]) == 3


# ---------------------------------------------------------------------- accounting
def test_banded_accounting_is_one_gaussian_of_the_separated_sensitivity() -> None:
    lib = dp()
    for sigma, steps, bands, cap in ((5.0, 127, 8, 5), (3.0, 20, 64, 5), (4.0, 9, 3, 2)):
        # k whole bands fit in the run: sqrt(k) times the first column's norm
        col = float(np.linalg.norm(_banded(bands, steps)[:, 0]))
        k = min(cap, math.ceil(steps / bands))
        direct = lib.rdp.RdpAccountant()
        direct.compose(lib.GaussianDpEvent(sigma / (math.sqrt(k) * col)))
        ours = Accountant("banded_mf", sigma, 1e-5, max_participations=cap, bands=bands)
        assert ours.epsilon_after(steps) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    # no cap, 10 aggregations 4 apart: columns 0, 4 and 8, the last cut to 2 rows by the run's end
    direct = lib.rdp.RdpAccountant()
    direct.compose(lib.GaussianDpEvent(2.0 / _brute_sensitivity(10, 4, 3)))
    ours = Accountant("banded_mf", 2.0, 1e-5, bands=4)
    assert ours.epsilon_after(10) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_the_budget_stops_a_banded_run_at_the_last_aggregation_within_the_target() -> None:
    dp()
    cfg = validate(
        {
            "aggregator": {"normalize": "count"},
            "privacy": {
                "mechanism": "banded_mf",
                "bands": 4,
                "noise_multiplier": 3.0,
                "max_participations": 3,
                "target_epsilon": 3.0,
            },
        }
    )
    budget = PrivacyBudget(cfg, None)
    eps = Accountant("banded_mf", 3.0, 1e-5, max_participations=3, bands=4).epsilon_after
    assert budget.max_steps is not None and budget.max_steps > 1
    assert eps(budget.max_steps) <= 3.0 < eps(budget.max_steps + 1)


# ---------------------------------------------------------------------- the separation rule
def test_a_client_may_contribute_again_only_bands_aggregations_later() -> None:
    rule = Separation(3)
    rule.aggregated([4, 5], 1)  # aggregation 1 took clients 4 and 5
    assert not rule.allows(4, 1) and not rule.allows(4, 2)  # aggregations 2 and 3: within the bands
    assert set(rule.blocked([7]).tolist()) == {4, 5, 7}  # 7 has an update buffered
    rule.aggregated([6], 2)
    assert set(rule.blocked([]).tolist()) == {4, 5, 6}
    rule.aggregated([], 3)
    assert rule.allows(4, 3) and set(rule.blocked([]).tolist()) == {6}  # aggregation 4 = 1 + 3
    restored = Separation(3)
    restored.load_state_dict(rule.state_dict())
    assert not restored.allows(6, 3) and restored.allows(6, 4)
    assert Separation(1).blocked([1, 2]).size == 0 and Separation(1).allows(1, 0)


def _contributions(tmp: Path, privacy: dict[str, Any]) -> tuple[dict[int, list[int]], Any]:
    """Each client's aggregations in a private run, as the orchestrator applied them."""
    cfg = resolve_config(
        None, "fedbuff", {**TINY, "run": {**TINY["run"], "max_aggregations": 8}, "privacy": privacy}
    )
    from felix.sim.build import build

    built = build(cfg)
    seen: dict[int, list[int]] = {}
    applied = built.orch._apply_aggregate

    def spy(buffer: list[BufferedUpdate], *args: Any) -> None:
        applied(buffer, *args)
        for b in buffer:
            seen.setdefault(b.client_id, []).append(built.orch.version)

    built.orch._apply_aggregate = spy  # type: ignore[method-assign]
    built.sim.run()
    return seen, built


def test_the_orchestrator_keeps_a_clients_contributions_bands_apart(tmp_path: Path) -> None:
    """12 clients, 4 training at a time, buffers of 2: without the rule clients return to the next
    aggregations; with 3 bands every client's aggregations are at least 3 apart, and the
    orchestrator holds the rule's state in its checkpoint."""
    dp()
    free, _ = _contributions(tmp_path, {"mechanism": "dp_ftrl", "noise_multiplier": 2.0})
    gaps = [b - a for v in free.values() for a, b in pairwise(v)]
    assert min(gaps) < 3  # the run would break the rule without it
    banded, built = _contributions(tmp_path, {"mechanism": "banded_mf", "bands": 3, "noise_multiplier": 2.0})
    gaps = [b - a for v in banded.values() for a, b in pairwise(v)]
    assert gaps and min(gaps) >= 3
    assert built.orch.version == 8 and built.orch.separation.bands == 3
    assert set(built.orch.state_dict()["separation"]["ids"].tolist()) == {
        c for c, v in banded.items() if v[-1] > 8 - 2
    }


# ---------------------------------------------------------------------- a run, and bad input
def test_a_banded_run_reports_its_epsilon_after_each_aggregation(tmp_path: Path) -> None:
    lib = dp()
    sigma, bands = 3.0, 4
    privacy = {"mechanism": "banded_mf", "bands": bands, "noise_multiplier": sigma, "clip_norm": 0.5}
    cfg = resolve_config(None, "fedbuff", {**TINY, "privacy": {**privacy, "max_participations": 2}})
    run_config(cfg, tmp_path / "bmf", plots=False)
    p = json.loads((tmp_path / "bmf" / "summary.json").read_text())["privacy"]
    assert p["mechanism"] == "banded_mf" and p["bands"] == bands and p["aggregations"] == 6
    assert 0 < p["max_contribution_norm"] <= 0.5 * (1 + 1e-6)

    def direct(steps: int) -> float:
        if steps == 0:
            return 0.0
        acc = lib.rdp.RdpAccountant()
        acc.compose(lib.GaussianDpEvent(sigma / _brute_sensitivity(steps, bands, 2)))
        return float(acc.get_epsilon(1e-5))

    assert p["epsilon"] == pytest.approx(direct(6), rel=1e-9)
    lines = (tmp_path / "bmf" / "evaluations.csv").read_text().splitlines()
    assert lines[0].endswith(",epsilon") and len(lines) > 2
    for line in lines[1:]:
        version, eps = int(line.split(",")[1]), float(line.split(",")[-1])
        assert eps == pytest.approx(direct(version), rel=1e-9)


@pytest.mark.parametrize(
    ("privacy", "says"),
    [
        ({"mechanism": "banded_mf", "bands": 0}, "privacy.bands"),
        ({"mechanism": "banded_mf"}, "mechanism banded_mf needs privacy.bands"),
        ({"mechanism": "dp_ftrl", "bands": 4}, "privacy.bands is for mechanism banded_mf, not dp_ftrl"),
        ({"bands": 4}, "privacy.bands is for mechanism banded_mf, not none"),
        (
            {"mechanism": "banded_mf", "bands": 11},
            (
                "privacy.bands 11: 11 aggregations of agg_goal 10 need 110 distinct clients (each sits out 10 "
                "after contributing), more than the 100 of partition.num_clients: set bands <= 10"
            ),
        ),
    ],
)
def test_bad_banded_settings_are_refused_in_one_line(privacy: dict[str, Any], says: str) -> None:
    """Among them, bands the population cannot serve (100 clients, buffers of 10: 10 bands use
    every client once per window, 11 would stall the run)."""
    base = {
        "aggregator": {"normalize": "count"},
        "partition": {"num_clients": 100},
        "orchestrator": {"agg_goal": 10},
    }
    with pytest.raises(ConfigError) as err:
        validate({**base, "privacy": privacy})
    assert says in str(err.value) and "\n" not in str(err.value)
    if privacy.get("bands") == 11:  # the largest that fits is accepted, and a run shorter than the bands
        validate({**base, "privacy": {**privacy, "bands": 10}})
        validate({**base, "privacy": privacy, "run": {"max_aggregations": 10}})


def test_a_resumed_server_continues_the_same_noise_and_separation(tmp_path: Path) -> None:
    """The deployment's checkpoint (the orchestrator's state: the mechanism's last b - 1 noise
    vectors and generator, the separation rule's recent contributors) restores a server that
    releases the same models from the same future."""
    dp()
    from felix.core.events import ClientRegistered, Event, TaskFinished, Tick
    from felix.core.orchestrator import Orchestrator
    from felix.core.types import TaskKind, Tier
    from felix.deploy import checkpoint as ckpt
    from felix.engine.components import build_orchestrator
    from felix.scenario.build import build_population

    n = 16
    cfg = resolve_config(
        None,
        "fedbuff",
        {
            **TINY,
            "partition": {"num_clients": n},
            "orchestrator": {"agg_goal": 3, "concurrency": 5},
            "privacy": {"mechanism": "banded_mf", "bands": 3, "noise_multiplier": 1.0, "clip_norm": 0.5},
        },
    )

    def orch() -> Orchestrator:
        o = build_orchestrator(cfg, build_population(cfg).initial_weights, None)
        for c in range(n):
            o.handle(ClientRegistered(0.0, c, 20 + c, Tier.AVL_TRAIN, (10, 10 + c)))
        return o

    def replies(o: Orchestrator, rng: np.random.Generator) -> list[Event]:
        t, evs = o.now, []
        for task in o.tasks():
            t += 1.0
            assert task.kind is TaskKind.TRAIN
            d = rng.normal(size=o.weights.size)
            delta = (d * (0.4 / np.linalg.norm(d))).astype(np.float32)  # clipped, as a device does
            evs.append(TaskFinished(t, task.client_id, task.task_id, ClientUpdate(20, 1.0, 0.7, 5.0, delta)))
        return [*evs, Tick(t + 200)]

    def drive(o: Orchestrator, seed: int) -> list[np.ndarray]:
        out = [c for e in replies(o, np.random.default_rng(seed)) for c in o.handle(e)]
        return [np.asarray(c.weights) for c in out if hasattr(c, "weights")]

    live = orch()
    for i in range(4):
        drive(live, i)
    assert live.version >= 4 and len(live.aggregator.privacy.state_dict()["noise"]["past"]) == 2  # type: ignore[union-attr]
    path = tmp_path / "ck.safetensors"
    ckpt.save_checkpoint(path, {"orchestrator": live.state_dict(), "shell": {}})
    restored = orch()
    restored.load_state_dict(ckpt.load_checkpoint(path)["orchestrator"])
    assert set(restored.separation.blocked([]).tolist()) == set(live.separation.blocked([]).tolist())
    for i in range(4, 8):
        ahead, again = drive(live, i), drive(restored, i)
        assert ahead and len(ahead) == len(again)
        assert all(np.array_equal(a, b) for a, b in zip(ahead, again, strict=True))


@pytest.mark.parametrize("privacy", [{"mechanism": "dp_ftrl"}, {"mechanism": "banded_mf", "bands": 2}])
def test_the_ftrl_mechanisms_are_refused_with_secure_aggregation(privacy: dict[str, Any]) -> None:
    """Secure aggregation noises the unmasked sum with the central Gaussian mechanism only: the
    FTRL mechanisms beside it are refused when the config is read, not failed at build time."""
    raw = {**TINY, "secure_aggregation": {"protocol": "buffered"}, "privacy": privacy}
    with pytest.raises(ConfigError, match=f"mechanism {privacy['mechanism']} with secure_aggregation"):
        resolve_config(None, "fedbuff", raw)


def test_a_late_reply_within_the_bands_is_not_applied() -> None:
    """One client: its first task times out, its second is applied (aggregation 1); the first's
    late reply would fall in aggregation 2, within 3 bands of the client's last: discarded."""
    from felix.core.events import ClientRegistered, TaskFinished, Tick
    from felix.core.types import Tier
    from felix.engine.components import build_orchestrator
    from felix.scenario.build import build_population

    cfg = resolve_config(
        None,
        "fedbuff",
        {
            **TINY,
            "partition": {"num_clients": 3},
            "orchestrator": {"agg_goal": 1, "concurrency": 1, "task_timeout_s": 10.0},
            "privacy": {"mechanism": "banded_mf", "bands": 3, "noise_multiplier": 1.0, "clip_norm": 0.5},
        },
    )
    orch = build_orchestrator(cfg, build_population(cfg).initial_weights, None)
    update = ClientUpdate(20, 1.0, 0.7, 5.0, np.full(orch.weights.size, 1e-3, dtype=np.float32))
    orch.handle(ClientRegistered(0.0, 0, 20, Tier.AVL_TRAIN, (10, 10)))
    orch.handle(Tick(20.0))  # task 1 times out: its reply may still come
    orch.handle(Tick(40.0))  # the client is asked again: task 2
    assert sorted(t.task_id for t in orch.tasks()) == [1, 2]
    orch.handle(TaskFinished(41.0, 0, 2, update))
    assert orch.version == 1 and orch.stats.updates_discarded == 0
    orch.handle(TaskFinished(42.0, 0, 1, update))
    assert orch.version == 1 and orch.stats.updates_discarded == 1
    assert not orch.tasks()  # nor is the client asked again within the bands
