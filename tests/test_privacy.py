"""User-level differential privacy (felix.privacy, docs/privacy.md): the config's refusals, the
central Gaussian mechanism's clip bound and noise, the participation cap, and the accountant's
epsilon against dp-accounting's own computation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from felix.config import ConfigError, validate
from felix.engine.setup import resolve_config
from felix.sim.run import run_config

TINY: dict[str, Any] = {
    "partition": {"num_clients": 12},
    "model": "mlp",
    "trace": {"kind": "always"},
    "run": {"max_aggregations": 4, "target_accuracy": 0.3, "target_window": 1, "stop_at_target": False},
    "orchestrator": {"concurrency": 4, "agg_goal": 2},
}
DP = {"aggregator": {"normalize": "count"}}


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"privacy": {"noise_multiplier": 0}}, "privacy.noise_multiplier: must be > 0"),
        ({"privacy": {"noise_multiplier": -1}}, "privacy.noise_multiplier: must be > 0"),
        ({"privacy": {"clip_norm": 0}}, "privacy.clip_norm: must be > 0"),
        ({"privacy": {"delta": 1}}, "privacy.delta: must lie strictly between 0 and 1"),
        ({"privacy": {"delta": 0}}, "privacy.delta: must lie strictly between 0 and 1"),
        ({"privacy": {"mechanism": "dp_ftrl"}}, "'dp_ftrl' is not built yet: use central_gaussian"),
        ({"privacy": {"mechanism": "local"}}, "'local' is not built yet"),
        ({"privacy": {"mechanism": "laplace"}}, "mechanism must be none or central_gaussian"),
        ({"privacy": {"accountant": "pld"}}, "'pld' is not built yet: use rdp"),
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


def test_privacy_is_off_by_default_and_left_out_of_the_written_config() -> None:
    cfg = validate({})
    assert not cfg.privacy.enabled
    assert "privacy" not in json.loads(cfg.model_dump_json())
    on = validate({"privacy": {"mechanism": "central_gaussian"}, **DP})
    assert json.loads(on.model_dump_json())["privacy"]["mechanism"] == "central_gaussian"


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
