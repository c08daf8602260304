"""The privacy mechanisms beyond the central Gaussian one (felix.privacy, docs/privacy.md): DP-FTRL's
tree aggregation and its accounting, the PLD accountant, local DP on the device, adaptive clipping;
each checked against a direct computation (dp-accounting's own, a brute force, replayed noise)."""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from privacy_support import dp, tiny

from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.setup import resolve_config
from felix.privacy.accountant import Accountant
from felix.privacy.adaptive import AdaptiveClip, update_noise_multiplier
from felix.privacy.central import CentralGaussian
from felix.privacy.ftrl import TreeAggregation
from felix.privacy.local import LocalMechanism
from felix.privacy.tree import TreeNoise, depth, nodes_of, sensitivity_sq
from felix.sim.run import run_config
from felix.strategies.aggregation.fedavg import FedBuffAggregator

TINY: dict[str, Any] = tiny(4)


def _buffer(deltas: list[np.ndarray]) -> list[BufferedUpdate]:
    return [
        BufferedUpdate(i, i, 0, 0.0, ClientUpdate(60, 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
        for i, d in enumerate(deltas)
    ]


def _run(tmp: Path, name: str, extra: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    cfg = resolve_config(None, "fedbuff", {**TINY, **extra})
    result = run_config(cfg, tmp / name, plots=False)
    return json.loads((tmp / name / "summary.json").read_text()), result


# ---------------------------------------------------------------------- the tree
def _leaves(node: tuple[int, int]) -> range:
    j, k = node
    return range((k - 1) * 2**j + 1, k * 2**j + 1)


@pytest.mark.parametrize("t", [1, 2, 3, 6, 7, 8, 13, 64, 100])
def test_a_prefix_is_its_binary_decomposition_of_complete_disjoint_nodes(t: int) -> None:
    covered = sorted(s for node in nodes_of(t) for s in _leaves(node))
    assert covered == list(range(1, t + 1))
    assert len(nodes_of(t)) == t.bit_count() <= depth(t)


def _brute_sensitivity_sq(m: int, steps: int) -> int:
    """The largest sum over complete nodes of (a client's steps in the node)^2, over every choice of
    the client's m steps."""
    best = 0
    for chosen in combinations(range(1, steps + 1), m):
        total = 0
        for j in range(depth(steps)):
            for k in range(1, (steps >> j) + 1):
                c = sum(1 for s in chosen if s in _leaves((j, k)))
                total += c * c
        best = max(best, total)
    return best


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 9])
def test_tree_sensitivity_equals_the_brute_force_worst_case(steps: int) -> None:
    for m in range(1, steps + 1):
        assert sensitivity_sq(m, steps) == _brute_sensitivity_sq(m, steps), (m, steps)
    assert sensitivity_sq(1, steps) == math.ceil(math.log2(steps + 1))


@pytest.mark.parametrize(("t", "nodes"), [(7, 3), (8, 1), (6, 2)])
def test_the_released_prefix_carries_one_node_noise_per_set_bit(t: int, nodes: int) -> None:
    """Zero updates: after t aggregations the model has moved by the prefix noise over K, whose std
    is sigma C sqrt(popcount t) / K (the step differences telescope)."""
    sigma, c, k, n = 0.8, 0.5, 4, 100_000
    agg = FedBuffAggregator(normalize="count")
    agg.privacy = TreeAggregation(sigma, c, k, np.random.default_rng(2))
    theta = np.zeros(n, dtype=np.float32)
    for _ in range(t):
        theta, _, _ = agg.aggregate(theta, _buffer([np.zeros(n)]))
    expected = sigma * c * math.sqrt(nodes) / k
    assert abs(float(np.std(theta, ddof=1)) - expected) < 5 * expected / math.sqrt(2 * (n - 1))


def test_tree_noise_reuses_its_nodes_and_holds_few() -> None:
    """The prefix noise of t and t + 1 share the nodes both decompositions hold: prefix 6 = nodes
    (2,1) + (1,3); prefix 7 = the same + (0,7), so their difference is node (0,7) alone."""
    tree = TreeNoise(50_000, 1.0, np.random.default_rng(0))
    prefixes = [tree.advance() for _ in range(7)]
    step7 = prefixes[6] - prefixes[5]
    assert abs(float(np.std(step7)) - 1.0) < 0.02  # one node, not three
    assert len(tree._nodes) == 3


def test_dp_ftrl_accounting_equals_dp_accountings_tree_aggregation() -> None:
    """One participation per client: dp-accounting's single-epoch tree aggregation (Kairouz et al.,
    appendix D) gives the same epsilon; m participations: one Gaussian of multiplier sigma / sqrt(S)."""
    lib = dp()
    for sigma, steps in ((2.0, 100), (5.0, 1000), (10.0, 7)):
        acc = lib.rdp.RdpAccountant(neighboring_relation=lib.NeighboringRelation.REPLACE_SPECIAL)
        acc.compose(lib.SingleEpochTreeAggregationDpEvent(sigma, steps))
        ours = Accountant("dp_ftrl", sigma, 1e-5, max_participations=1)
        assert ours.epsilon_after(steps) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    direct = lib.rdp.RdpAccountant()
    direct.compose(lib.GaussianDpEvent(5.0 / math.sqrt(_brute_sensitivity_sq(3, 9))))
    assert Accountant("dp_ftrl", 5.0, 1e-5, max_participations=3).epsilon_after(9) == pytest.approx(
        direct.get_epsilon(1e-5), rel=1e-9
    )


def test_a_dp_ftrl_run_reports_the_tree_epsilon_after_each_aggregation(tmp_path: Path) -> None:
    lib = dp()
    sigma, delta = 3.0, 1e-5
    privacy = {"mechanism": "dp_ftrl", "noise_multiplier": sigma, "clip_norm": 0.5, "max_participations": 2}
    summary, _ = _run(tmp_path, "ftrl", {"privacy": privacy})
    p = summary["privacy"]
    assert p["mechanism"] == "dp_ftrl" and p["aggregations"] == 4 and p["amplification"] == "none"
    direct = lib.rdp.RdpAccountant()
    direct.compose(lib.GaussianDpEvent(sigma / math.sqrt(sensitivity_sq(2, 4))))
    assert p["epsilon"] == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
    assert 0 < p["max_contribution_norm"] <= 0.5 * (1 + 1e-6)
    rows = (tmp_path / "ftrl" / "evaluations.csv").read_text().splitlines()
    eps = [float(r.split(",")[-1]) for r in rows[1:]]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(p["epsilon"])


# ---------------------------------------------------------------------- PLD
@pytest.mark.parametrize(
    ("mechanism", "extra", "event"),
    [
        ("central_gaussian", {}, lambda lib: lib.SelfComposedDpEvent(lib.GaussianDpEvent(4.0), 30)),
        (
            "local",
            {"max_participations": 3, "noise": "laplace"},
            lambda lib: lib.SelfComposedDpEvent(lib.LaplaceDpEvent(2.0), 3),
        ),
    ],
)
def test_pld_epsilon_equals_dp_accountings_direct_computation(
    mechanism: str, extra: dict[str, Any], event: Any
) -> None:
    lib = dp()
    direct = lib.pld.PLDAccountant()  # the library's default (finer) discretisation
    direct.compose(event(lib))
    ours = Accountant(mechanism, 4.0, 1e-5, kind="pld", **extra).epsilon_after(30)
    assert ours == pytest.approx(direct.get_epsilon(1e-5), rel=1e-5)
    # and never below the finer grid's: a coarser grid only over-reports
    assert ours >= direct.get_epsilon(1e-5) - 1e-9


def test_a_run_with_the_pld_accountant_says_so(tmp_path: Path) -> None:
    lib = dp()
    privacy = {"mechanism": "central_gaussian", "noise_multiplier": 2.0, "accountant": "pld"}
    summary, _ = _run(tmp_path, "pld", {"privacy": privacy})
    direct = lib.pld.PLDAccountant()
    direct.compose(lib.SelfComposedDpEvent(lib.GaussianDpEvent(2.0), 4))
    assert summary["privacy"]["accountant"] == "pld"
    assert summary["privacy"]["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-5)


# ---------------------------------------------------------------------- local DP
def _upd(delta: np.ndarray | None) -> ClientUpdate:
    return ClientUpdate(10, 1.0, 1.0, 0.0, None if delta is None else delta.astype(np.float32))


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_a_local_report_is_the_clipped_update_plus_noise_of_scale_sigma_c(noise: str) -> None:
    sigma, c, n = 0.5, 2.0, 200_000
    big = np.full(n, 3.0)
    mech = LocalMechanism(sigma, c, noise, max_participations=5, seed=9)
    out = mech.release(4, 17, _upd(big)).delta
    assert out is not None
    rng = np.random.default_rng(np.random.SeedSequence([9, 0x4C4F43, 17]))
    replay = rng.laplace(0.0, sigma * c, n) if noise == "laplace" else rng.normal(0.0, sigma * c, n)
    signal = out.astype(np.float64) - replay
    norm = float(np.abs(signal).sum()) if noise == "laplace" else float(np.linalg.norm(signal))
    assert norm == pytest.approx(c, rel=1e-3)  # the clip ball: L1 for Laplace, L2 for Gaussian
    std = sigma * c * (math.sqrt(2) if noise == "laplace" else 1.0)
    assert abs(float(np.std(replay)) - std) < 0.01 * std
    assert mech.release(4, 18, _upd(None)).delta is None  # an eval's reply carries no update


def test_beyond_its_cap_a_device_sends_noise_alone() -> None:
    mech = LocalMechanism(1.0, 1.0, "gaussian", max_participations=2, seed=1)
    d = np.full(1000, 0.03)  # norm about 0.95, within the clip
    rng = lambda task: np.random.default_rng(np.random.SeedSequence([1, 0x4C4F43, task]))
    for task in (1, 2):
        out = mech.release(7, task, _upd(d)).delta
        np.testing.assert_allclose(out - rng(task).normal(0.0, 1.0, 1000), d, atol=1e-5)
    out = mech.release(7, 3, _upd(d)).delta
    np.testing.assert_allclose(out - rng(3).normal(0.0, 1.0, 1000), 0.0, atol=1e-5)
    assert mech.reports[7] == 3


def test_local_dp_runs_on_the_simulated_devices_and_is_accounted_per_client(tmp_path: Path) -> None:
    """Every training result leaves its device through the mechanism (its report count), epsilon is
    max_participations reports of multiplier sigma / 2 (the clip ball's diameter 2C)."""
    lib = dp()
    privacy = {"mechanism": "local", "noise_multiplier": 4.0, "clip_norm": 0.5, "max_participations": 2}
    summary, result = _run(tmp_path, "local", {"privacy": privacy})
    direct = lib.rdp.RdpAccountant()
    direct.compose(lib.SelfComposedDpEvent(lib.GaussianDpEvent(2.0), 2))
    p = summary["privacy"]
    assert p["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert p["mechanism"] == "local" and p["local_noise"] == "gaussian"
    mech = result.built.sim._rules.privacy
    assert sum(mech.reports.values()) >= summary["updates_applied"] == 8
    # the noise reached the server: the model moved far more than clipped updates could move it
    moved = float(np.linalg.norm(result.built.orch.weights - result.built.population.initial_weights))
    assert moved > 4 * 0.5


# ---------------------------------------------------------------------- adaptive clipping
def test_adaptive_clipping_splits_the_noise_so_the_pair_is_one_gaussian_of_sigma() -> None:
    """Andrew et al.'s Theorem 1 checked by dp-accounting: the updates at z_delta and the count at
    2 sigma_b compose to exactly the epsilon of one Gaussian mechanism at sigma."""
    lib = dp()
    sigma, sigma_b, steps = 1.5, 5.0, 50
    z = update_noise_multiplier(sigma, sigma_b)
    assert z > sigma
    pair = lib.rdp.RdpAccountant()
    pair.compose(
        lib.SelfComposedDpEvent(
            lib.ComposedDpEvent([lib.GaussianDpEvent(z), lib.GaussianDpEvent(2 * sigma_b)]), steps
        )
    )
    assert Accountant("central_gaussian", sigma, 1e-5).epsilon_after(steps) == pytest.approx(
        pair.get_epsilon(1e-5), rel=1e-9
    )
    with pytest.raises(ValueError, match="must exceed noise_multiplier / 2"):
        update_noise_multiplier(2.0, 1.0)


def test_the_clip_norm_tracks_the_target_quantile_of_the_update_norms() -> None:
    """100 clients whose norms spread over 1..100: from C = 1 the clip norm climbs to about the
    target quantile (the 30th norm for 0.3), through a noised count."""
    k, n = 100, 20
    norms = np.arange(1, k + 1, dtype=np.float64)
    rng = np.random.default_rng(4)
    deltas = [np.full(n, v / math.sqrt(n)) for v in norms]
    mech = CentralGaussian(1.0, 1.0, k, rng, AdaptiveClip(0.3, 0.2, 2.0, k))
    agg = FedBuffAggregator(normalize="count")
    agg.privacy = mech
    theta = np.zeros(n, dtype=np.float32)
    seen = []
    for _ in range(200):
        bound = mech.clip_norm
        before = mech.max_contribution_norm = 0.0
        agg.aggregate(theta, _buffer(deltas))
        assert (
            before <= mech.max_contribution_norm <= bound * (1 + 1e-9)
        )  # each applied contribution within this C
        seen.append(mech.clip_norm)
    assert 25 < float(np.mean(seen[-50:])) < 36
    assert mech.noise_std == pytest.approx(update_noise_multiplier(1.0, 2.0) * mech.clip_norm)


def test_an_adaptive_run_reports_its_final_clip_and_split_noise(tmp_path: Path) -> None:
    dp()
    privacy = {
        "mechanism": "central_gaussian",
        "noise_multiplier": 0.5,
        "clip_norm": 0.01,
        "adaptive_clip": {"target_quantile": 0.5, "learning_rate": 0.5, "count_noise": 0.3},
    }
    summary, _ = _run(tmp_path, "adaptive", {"privacy": privacy})
    p = summary["privacy"]
    assert p["final_clip_norm"] > 0.012  # it grew: the training updates are far above 0.01
    assert p["update_noise_multiplier"] == pytest.approx(update_noise_multiplier(0.5, 0.3))


# ---------------------------------------------------------------------- the server re-checks
@pytest.mark.parametrize(
    ("privacy", "ok_norm", "bad_norm"),
    [
        ({"mechanism": "central_gaussian", "clip_norm": 0.5}, 0.5, 0.51),
        ({"mechanism": "dp_ftrl", "clip_norm": 0.5}, 0.5, 0.51),
        # local: sigma C (sqrt(d) + 10) of noise room above the clip (sigma 0.1)
        (
            {"mechanism": "local", "clip_norm": 0.5, "max_participations": 1},
            0.5 + 0.05 * (math.sqrt(2000) + 10),
            4.0,
        ),
    ],
)
def test_the_server_refuses_an_update_beyond_the_private_bound(
    privacy: dict[str, Any], ok_norm: float, bad_norm: float
) -> None:
    """A device that skips its clip (or, under local DP, sends more than clip plus noise) is refused."""
    from felix.config import validate
    from felix.core.types import TaskKind
    from felix.core.validation import UpdateValidator
    from felix.privacy.setup import private_norm_bound

    p = validate(
        {"privacy": {**privacy, "noise_multiplier": 0.1}, "aggregator": {"normalize": "count"}}
    ).privacy
    v = UpdateValidator()
    v.privacy_bound = private_norm_bound(p, 2000)
    d = np.ones(2000) / math.sqrt(2000)
    theta = np.zeros(2000, dtype=np.float32)
    assert v.check(1, TaskKind.TRAIN, _upd(d * ok_norm * 0.999), 10, 0, theta).update is not None
    verdict = v.check(2, TaskKind.TRAIN, _upd(d * bad_norm), 10, 0, theta)
    assert verdict.update is None and "privacy" in verdict.reason


# ---------------------------------------------------------------------- reports (probes)
def test_a_reply_reports_one_clipped_noised_loss_and_noise_alone_beyond_its_cap() -> None:
    from felix.privacy.local import ScalarNoise

    mech = LocalMechanism(None, 1.0, scalars=ScalarNoise(0.5, 4.0, 2), seed=3)
    noise = lambda task: np.random.default_rng(np.random.SeedSequence([3, 0x4C4F43, task])).normal(0.0, 2.0)
    probe = ClientUpdate(50, 50 * 9.0, 8.0, 0.0)  # RMS loss 9, above the clip 4
    for task, rms in ((1, 4.0), (2, 4.0), (3, 0.0)):  # the third is beyond the cap: no data in it
        out = mech.release(5, task, probe)
        expected = max(rms + noise(task), 0.0)
        assert out.loss == pytest.approx(expected) and out.stat_utility == pytest.approx(50 * expected)
        assert out.delta is None


def test_a_felix_run_accounts_its_probes_and_without_reports_is_refused(tmp_path: Path) -> None:
    from felix.config import ConfigError

    lib = dp()
    privacy = {"mechanism": "dp_ftrl", "noise_multiplier": 3.0, "clip_norm": 0.5, "max_participations": 2}
    with pytest.raises(ConfigError, match=r"selector 'oort' reads the losses .* set privacy.reports"):
        resolve_config(None, "felix", {**TINY, "privacy": privacy})
    reports = {"noise_multiplier": 4.0, "clip": 5.0, "max_per_client": 6}
    cfg = resolve_config(None, "felix", {**TINY, "privacy": {**privacy, "reports": reports}})
    assert cfg.eval_selector.name == "tierselect"
    result = run_config(cfg, tmp_path / "felix", plots=False)
    p = json.loads((tmp_path / "felix" / "summary.json").read_text())["privacy"]
    steps = p["aggregations"]
    direct = lib.rdp.RdpAccountant()
    direct.compose(lib.GaussianDpEvent(3.0 / math.sqrt(sensitivity_sq(2, steps))))
    direct.compose(lib.SelfComposedDpEvent(lib.GaussianDpEvent(4.0), 6))
    assert p["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    mech = result.built.sim._rules.privacy
    assert sum(mech.scalar_reports.values()) > summary_updates(result)  # probes went through it too


def summary_updates(result: Any) -> int:
    """Training replies applied (each also sent its loss)."""
    return int(result.summary["updates_applied"])


# ---------------------------------------------------------------------- the dp-* comparisons
@pytest.mark.parametrize(
    ("name", "clients", "k"),
    [("dp-fmnist-90", 10_000, 100), ("dp-fmnist-mobiperf", 10_000, 100), ("dp-fsdd-mobiperf", 2_500, 50)],
)
def test_the_dp_comparisons_give_each_budget_exactly_their_127_aggregations(
    name: str, clients: int, k: int
) -> None:
    """Every strategy at every epsilon on 10,000 clients with buffers / cohorts of 100 (FSDD: 2,500 and 50), every run
    capped at 127 aggregations; each private variant's noise is the smallest (to 0.01) whose budget
    lasts those 127, as benchmarks/dp_calibration.py computes it: 0.01 less noise would stop the
    run earlier."""
    dp()
    from felix.experiments.compare import load_comparison, variant_config
    from felix.privacy.budget import PrivacyBudget

    comp = load_comparison(name)
    strategies = {"felix", "felix-authors", "oort-async*", "fedbuff", "oort*", "fedavg"}
    assert set(comp.variants) == {f"{s}-eps{e}" for s in strategies for e in ("1", "2", "4", "8", "inf")}
    for variant in comp.variants:
        cfg = variant_config(comp, variant, {}, 0, max(comp.targets or [0.7]))
        assert cfg.partition.num_clients == clients and cfg.orchestrator.agg_goal == k
        assert cfg.run.max_aggregations == 127
        if variant.endswith("inf"):
            # without privacy, FedAvg's sample-count weights keep their own denominator
            sample_weighted = cfg.aggregator.name == "fedavg"
            assert cfg.aggregator.normalize == ("weights" if sample_weighted else "count"), variant
            assert not cfg.privacy.enabled
            continue
        assert cfg.aggregator.normalize == "count"
        assert cfg.privacy.target_epsilon == float(variant.rsplit("eps", 1)[1])
        budget = PrivacyBudget(cfg, None)
        assert budget.max_steps == 127, (variant, budget.max_steps)
        less = budget.accountant.with_noise(cfg.privacy.noise_multiplier - 0.01)
        assert less.epsilon_after(127) > cfg.privacy.target_epsilon, variant


def test_a_private_sync_run_is_the_run_of_the_scanned_round_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync round's top-up reads the ledger's per-round in-flight count: a private run with
    over-selection and stragglers cancelled at each round's end, under churn, gives, bit for bit,
    the run of the scan over the open tasks that the count replaced (every way out of a slot is
    checked against the scan in tests/test_ledger.py)."""
    dp()
    from felix.core.ledger import TaskLedger
    from felix.sim.build import build

    over = {
        **TINY,
        "partition": {"num_clients": 40},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.3, "slot_s": 20.0},
        "orchestrator": {"agg_goal": 4, "overcommit": 1.5},
        "run": {**TINY["run"], "max_aggregations": 8},
        "privacy": {"mechanism": "dp_ftrl", "noise_multiplier": 2.0, "clip_norm": 0.5},
    }

    def run() -> tuple[np.ndarray, list[Any], Any]:
        built = build(resolve_config(None, "fedavg", over))
        built.sim.run()
        rows = [(r.version, r.accuracy, r.loss, r.epsilon) for r in built.recorder.rows]
        return built.orch.weights.copy(), rows, built.orch.stats

    kept = run()
    monkeypatch.setattr(
        TaskLedger,
        "round_in_flight",
        lambda self, r: sum(t.holds_slot for t in self.round_tasks(r)),
    )
    scanned = run()
    assert kept[2].train_cancelled > 0  # stragglers left their slots
    assert np.array_equal(kept[0], scanned[0]) and kept[1] == scanned[1]
