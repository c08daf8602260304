"""User-level differential privacy (felix.privacy, docs/privacy.md): the config's refusals, the
central Gaussian mechanism's clip bound and noise, the participation cap, and the accountant's
epsilon against dp-accounting's own computation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from felix.config import ConfigError, validate
from felix.core.types import BufferedUpdate, ClientUpdate
from felix.engine.setup import resolve_config
from felix.privacy.central import CentralGaussian
from felix.sim.run import run_config
from felix.strategies.aggregation.fedavg import FedAvgAggregator, FedBuffAggregator

TINY: dict[str, Any] = {
    "partition": {"num_clients": 12},
    "model": "mlp",
    "trace": {"kind": "always"},
    "run": {"max_aggregations": 4, "target_accuracy": 0.3, "target_window": 1, "stop_at_target": False},
    "orchestrator": {"concurrency": 4, "agg_goal": 2},
}
DP = {"aggregator": {"normalize": "count"}}


def needs_accounting() -> Any:
    return pytest.importorskip(
        "dp_accounting", reason="extra felix-fl[privacy] (dp-accounting) not installed"
    )


def direct_epsilon(sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's own answer: ``steps`` Gaussian mechanisms, no sampling."""
    dp = needs_accounting()
    acc = dp.rdp.RdpAccountant()
    acc.compose(dp.SelfComposedDpEvent(dp.GaussianDpEvent(sigma), steps))
    return float(acc.get_epsilon(delta))


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"privacy": {"noise_multiplier": 0}}, "privacy.noise_multiplier: must be > 0"),
        ({"privacy": {"noise_multiplier": -1}}, "privacy.noise_multiplier: must be > 0"),
        ({"privacy": {"clip_norm": 0}}, "privacy.clip_norm: must be > 0"),
        ({"privacy": {"delta": 1}}, "privacy.delta: must lie strictly between 0 and 1"),
        ({"privacy": {"delta": 0}}, "privacy.delta: must lie strictly between 0 and 1"),
        (
            {"privacy": {"mechanism": "laplace"}},
            "mechanism must be one of none, central_gaussian, dp_ftrl, banded_mf, local",
        ),
        (
            {"privacy": {"mechanism": "local"}},
            "mechanism local composes each client's reports: set max_participations",
        ),
        ({"privacy": {"local_noise": "laplace"}}, "local_noise laplace is for mechanism local"),
        (
            {"privacy": {"mechanism": "dp_ftrl", "adaptive_clip": {}}},
            "adaptive_clip is built for central_gaussian, not dp_ftrl",
        ),
        (
            {
                "privacy": {"mechanism": "central_gaussian", "adaptive_clip": {}},
                "aggregator": {"normalize": "count"},
            },
            "adaptive_clip.count_noise 0.5 must exceed noise_multiplier / 2 (0.5)",
        ),
        ({"privacy": {"adaptive_clip": {"target_quantile": 1.0}}}, "privacy.adaptive_clip.target_quantile"),
        ({"privacy": {"accountant": "prv"}}, "privacy.accountant"),
        ({"privacy": {"mechanism": "central_gaussian"}}, "set aggregator.normalize: count"),
        (
            {
                "privacy": {"mechanism": "central_gaussian"},
                "aggregator": {"normalize": "count", "robust": "median"},
            },
            "set robust: none",
        ),
        (
            {
                "privacy": {"mechanism": "central_gaussian"},
                "aggregator": {"name": "refl_saa", "normalize": "count"},
            },
            "aggregator 'refl_saa' has no bounded sensitivity: use fedavg, fedbuff, tierfuse",
        ),
        (
            {
                "privacy": {"mechanism": "central_gaussian"},
                "aggregator": {"normalize": "count"},
                "client": {"objective": "scaffold"},
            },
            "client.objective 'scaffold' sends aux state",
        ),
    ],
)
def test_bad_privacy_settings_are_refused_in_one_line(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


def undeclared_selector(params: Any, ctx: Any) -> Any:
    """A selector by import path, registered nowhere: it declares nothing about reports."""
    from felix.core.selection import TrainSelector

    return TrainSelector()


PRIVATE = {"privacy": {"mechanism": "dp_ftrl", "noise_multiplier": 3.0, "max_participations": 2}, **DP}
REPORTS = {"noise_multiplier": 4.0, "max_per_client": 6}


@pytest.mark.parametrize(
    ("components", "says"),
    [
        ({"selector": {"name": "oort"}}, "selector 'oort' reads the losses and utilities"),
        (
            {"selector": {"name": "refl_ips", "params": {"oort": {}}}},
            "selector 'refl_ips' reads the losses and utilities",
        ),
        ({"eval_selector": {"name": "tierselect"}}, "eval_selector 'tierselect' reads the losses"),
        (
            {"aggregator": {"name": "tierfuse", "normalize": "count"}},
            "aggregator 'tierfuse' reads the losses",
        ),
        (
            {"run": {"converge_threshold": 0.01}},
            "run.converge_threshold stops the run on the clients' reported",
        ),
        (
            {"selector": {"name": "test_privacy:undeclared_selector"}},
            "selector 'test_privacy:undeclared_selector' reads the losses",
        ),
    ],
)
def test_a_component_that_reads_reports_is_refused_without_private_reports(
    components: dict[str, Any], says: str
) -> None:
    """Un-noised losses and utilities would steer the run outside its epsilon: each reader, as its
    registry entry declares (an unregistered import path is taken to read), is refused in one line
    naming the alternatives; with privacy.reports the same components are accepted."""
    with pytest.raises(ConfigError) as err:
        validate({**PRIVATE, **components})
    assert says in str(err.value) and "set privacy.reports" in str(err.value)
    assert "\n" not in str(err.value)
    with_reports = {**PRIVATE["privacy"], "reports": REPORTS}
    assert validate({**PRIVATE, **components, "privacy": with_reports}).privacy.reports is not None


@pytest.mark.parametrize(
    "components",
    [
        {"selector": {"name": "refl_ips"}},  # random within REFL's priority classes
        {
            "aggregator": {"name": "tierfuse", "normalize": "count", "params": {"sigma": 1.0}}
        },  # staleness only
    ],
)
def test_a_component_that_reads_no_reports_under_its_parameters_is_accepted(
    components: dict[str, Any],
) -> None:
    assert validate({**PRIVATE, **components}).privacy.reports is None


@pytest.mark.parametrize("strategy", ["fedbuff", "fedavg"])
def test_random_selection_strategies_run_private_without_reports(tmp_path: Path, strategy: str) -> None:
    needs_accounting()
    cfg = resolve_config(None, strategy, {**TINY, **PRIVATE})
    assert cfg.selector.name == "random" and cfg.privacy.reports is None
    run_config(cfg, tmp_path / strategy, plots=False)
    summary = json.loads((tmp_path / strategy / "summary.json").read_text())
    assert summary["privacy"]["aggregations"] == 4 and "reports" not in summary["privacy"]


@pytest.mark.parametrize("strategy", ["oort*", "oort-async*"])
def test_oort_selection_reads_only_the_private_reports(tmp_path: Path, strategy: str) -> None:
    """With privacy.reports, the utilities Oort ranks clients by are the device's noised ones: at a
    report noise of 50 x the clip 10, RMS losses far above the clip reach the selector's column,
    which no real (clipped) loss could give."""
    needs_accounting()
    reports = {"noise_multiplier": 50.0, "clip": 10.0, "max_per_client": 10}
    cfg = resolve_config(
        None, strategy, {**TINY, **PRIVATE, "privacy": {**PRIVATE["privacy"], "reports": reports}}
    )
    assert cfg.selector.name == "oort"
    result = run_config(cfg, tmp_path / "run", plots=False)
    clients = result.built.orch.clients
    utility = clients.column("stat_utility")
    samples = clients.column("num_samples")
    seen = ~np.isnan(utility)
    assert seen.sum() >= 4
    rms = utility[seen] / np.maximum(samples[seen], 1)
    assert rms.max() > 10.0  # above the clip: noise, not a loss
    assert sum(result.built.sim._rules.privacy.scalar_reports.values()) >= seen.sum()


def test_privacy_is_off_by_default_and_left_out_of_the_written_config() -> None:
    cfg = validate({})
    assert not cfg.privacy.enabled
    assert "privacy" not in json.loads(cfg.model_dump_json())
    on = validate({"privacy": {"mechanism": "central_gaussian"}, **DP})
    assert json.loads(on.model_dump_json())["privacy"]["mechanism"] == "central_gaussian"


# ---------------------------------------------------------------------- the mechanism
def _buffer(
    deltas: list[np.ndarray], clients: list[int] | None = None, samples: int = 60
) -> list[BufferedUpdate]:
    ids = clients if clients is not None else list(range(len(deltas)))
    return [
        BufferedUpdate(cid, i, 0, 0.0, ClientUpdate(samples, 0.0, 0.0, 1.0, d.astype(np.float32)), 0)
        for i, (cid, d) in enumerate(zip(ids, deltas, strict=True))
    ]


def _replayed_noise(seed: int, sigma_c: float, size: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, sigma_c, size)


@pytest.mark.parametrize("agg_cls", [FedAvgAggregator, FedBuffAggregator])
def test_every_applied_contribution_respects_the_clip_bound(agg_cls: type) -> None:
    """The noise is replayed from the same seed and taken off the step: what remains is the sum of
    the clients' contributions, each at most C whatever its norm, its weight (FedAvg's 60 samples
    are capped at 1) or its number of updates in the aggregation."""
    c, k, n = 0.5, 4, 1000
    rng = np.random.default_rng(1)
    direction = rng.normal(size=n)
    big = direction / np.linalg.norm(direction) * 50.0
    for deltas, clients in (([big], [7]), ([big, 3 * big], [7, 7])):
        agg = agg_cls(server_lr=1.0, normalize="count")
        agg.privacy = CentralGaussian(0.8, c, k, np.random.default_rng(3))
        theta = np.zeros(n, dtype=np.float32)
        new, norm_w, _ = agg.aggregate(theta, _buffer(deltas, clients))
        contribution = new.astype(np.float64) * k - _replayed_noise(3, 0.8 * c, n)
        assert np.linalg.norm(contribution) == pytest.approx(c, rel=1e-4)
        assert np.all(norm_w <= 1.0 / k)
    assert agg.privacy.max_contribution_norm == pytest.approx(c, rel=1e-6)


def test_small_updates_are_not_scaled_up() -> None:
    n, c, k = 500, 1.0, 2
    d = np.full(n, 0.001)
    agg = FedBuffAggregator(normalize="count")
    agg.privacy = CentralGaussian(1.0, c, k, np.random.default_rng(5))
    new, _, _ = agg.aggregate(np.zeros(n, dtype=np.float32), _buffer([d]))
    contribution = new.astype(np.float64) * k - _replayed_noise(5, c, n)
    np.testing.assert_allclose(contribution, d, atol=1e-5)


@pytest.mark.parametrize(("sigma", "c", "k"), [(1.0, 1.0, 10), (0.7, 2.5, 4), (3.0, 0.1, 100)])
def test_noise_std_of_an_aggregation_is_sigma_c_over_the_denominator(sigma: float, c: float, k: int) -> None:
    """Zero updates: the step is the noise alone. The sample std of n normal draws has standard
    error std / sqrt(2 (n - 1)); the tolerance is 5 of those."""
    n = 200_000
    agg = FedBuffAggregator(normalize="count")
    agg.privacy = CentralGaussian(sigma, c, k, np.random.default_rng(11))
    buffer = _buffer([np.zeros(n) for _ in range(3)])
    new, _, _ = agg.aggregate(np.zeros(n, dtype=np.float32), buffer)
    expected = sigma * c / k
    tol = 5 * expected / math.sqrt(2 * (n - 1))
    assert abs(float(np.std(new, ddof=1)) - expected) < tol
    assert abs(float(np.mean(new))) < 5 * expected / math.sqrt(n)


# ---------------------------------------------------------------------- runs
def _run(tmp: Path, name: str, extra: dict[str, Any]) -> tuple[dict[str, Any], str]:
    cfg = resolve_config(None, "fedbuff", {**TINY, **extra})
    run_config(cfg, tmp / name, plots=False)
    summary = json.loads((tmp / name / "summary.json").read_text())
    return summary, (tmp / name / "evaluations.csv").read_text()


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "provenance")}


def test_privacy_none_runs_exactly_as_without_the_section(tmp_path: Path) -> None:
    absent, absent_csv = _run(tmp_path, "absent", {})
    none, none_csv = _run(tmp_path, "none", {"privacy": {"mechanism": "none", "noise_multiplier": 5.0}})
    assert "privacy" not in absent and "privacy" not in none
    assert _comparable(absent) == _comparable(none)
    assert absent_csv == none_csv
    assert "epsilon" not in absent_csv.splitlines()[0]


def test_run_epsilon_matches_dp_accounting_and_the_target_stops_the_run(tmp_path: Path) -> None:
    """sigma 1, delta 1e-5: epsilon after 4 aggregations is 10.73, after 5 is 12.30; a target of 11
    ends the run after the 4th, though max_aggregations allows 8."""
    needs_accounting()
    sigma, delta, target = 1.0, 1e-5, 11.0
    assert direct_epsilon(sigma, 4, delta) <= target < direct_epsilon(sigma, 5, delta)
    privacy = {"mechanism": "central_gaussian", "noise_multiplier": sigma, "clip_norm": 0.5, "delta": delta}
    summary, csv_text = _run(
        tmp_path,
        "dp",
        {
            **DP,
            "run": {**TINY["run"], "max_aggregations": 8},
            "privacy": {**privacy, "target_epsilon": target},
        },
    )
    p = summary["privacy"]
    assert summary["stop_reason"] == "privacy_budget_spent"
    assert p["aggregations"] == 4
    assert p["epsilon"] == pytest.approx(direct_epsilon(sigma, 4, delta), rel=1e-9)
    assert p["amplification"] == "none" and p["noise_source"] == "seeded" and p["accountant"] == "rdp"
    assert 0 < p["max_contribution_norm"] <= 0.5 * (1 + 1e-6)
    lines = csv_text.splitlines()
    assert lines[0].endswith(",epsilon")
    for line in lines[1:]:
        version, eps = int(line.split(",")[1]), float(line.split(",")[-1])
        assert eps == pytest.approx(direct_epsilon(sigma, version, delta) if version else 0.0, rel=1e-9)


def test_an_unreachable_target_is_refused_when_the_config_is_read_naming_the_noise_it_needs() -> None:
    needs_accounting()
    with pytest.raises(
        ConfigError, match=r"exceeded by one aggregation .* needs noise_multiplier >= \d"
    ) as err:
        validate(
            {
                **DP,
                "privacy": {"mechanism": "central_gaussian", "noise_multiplier": 0.5, "target_epsilon": 1.0},
            }
        )
    assert "\n" not in str(err.value)
    reports = {"noise_multiplier": 0.5, "max_per_client": 10}
    with pytest.raises(
        ConfigError, match=r"exceeded by the reports alone .* raise privacy.reports.noise_multiplier"
    ):
        validate(
            {
                **DP,
                "privacy": {
                    "mechanism": "central_gaussian",
                    "noise_multiplier": 50,
                    "target_epsilon": 2.0,
                    "reports": reports,
                },
            }
        )


def test_max_participations_is_enforced_by_the_orchestrator(tmp_path: Path) -> None:
    """6 clients, at most 2 updates each: 12 updates make 6 aggregations of 2, though 10 are allowed,
    and no client is selected once it has contributed 2."""
    needs_accounting()
    cfg = resolve_config(
        None,
        "fedbuff",
        {
            **TINY,
            **DP,
            "partition": {"num_clients": 6},
            # 6 aggregations take under 60 virtual seconds; the time limit bounds a run that ignores the cap
            "run": {**TINY["run"], "max_aggregations": 10, "max_time_s": 300.0},
            "privacy": {"mechanism": "central_gaussian", "max_participations": 2},
        },
    )
    result = run_config(cfg, None, plots=False)
    clients = result.built.orch.clients
    counts = clients.column("times_updated")
    assert counts.max() == 2
    # every client is always available and no task fails: one selection per contribution
    assert clients.column("times_selected").max() == 2
    assert int(counts.sum()) == result.summary["updates_applied"] == 12
    assert result.summary["privacy"]["aggregations"] == 6


def test_without_the_privacy_extra_a_private_run_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from felix.privacy.budget import PrivacyBudget

    monkeypatch.setitem(__import__("sys").modules, "dp_accounting", None)  # as if not installed
    cfg = validate({**DP, "privacy": {"mechanism": "central_gaussian"}})
    with pytest.raises(ConfigError, match=r"extra felix-fl\[privacy\]"):
        PrivacyBudget(cfg, None)
