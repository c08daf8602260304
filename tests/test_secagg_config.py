"""The ``secure_aggregation:`` config section: off by default and left out of a run's written
config, and every bad setting refused when the config is read, in one line naming why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from felix.config import ConfigError, validate

SYNC = {"orchestrator": {"mode": "sync"}, "aggregator": {"name": "fedavg"}}


def _sa(**kw: Any) -> dict[str, Any]:
    return {"secure_aggregation": {"protocol": "secagg_plus", **kw}, **SYNC}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (_sa(group_size=10, threshold=11), "threshold 11 exceeds group_size 10"),
        (_sa(group_size=1), "group_size 1: a group of one is its own sum"),
        (_sa(group_size=10, num_shares=5, threshold=6), "threshold 6 exceeds num_shares 5"),
        (_sa(group_size=10, threshold=5), "threshold 5 must exceed half of num_shares 10"),
        (_sa(group_size=10, num_shares=4), "num_shares 4 must be odd"),
        (
            _sa(group_size=1000, quantization_bits=24, modulus_bits=32),
            "modulus 2^32 overflows: a group of 1000",
        ),
        (_sa(quantization_bits=32, modulus_bits=32), "quantization_bits 32 must be below modulus_bits 32"),
        (_sa(protocol="lightsecagg"), "secure_aggregation.protocol"),
        (_sa(clipping_range=0), "clipping_range"),
        (_sa(link={"up_mbps": 0}), "secure_aggregation.link.up_mbps"),
        (_sa(link={"rtt_s": -0.1}), "secure_aggregation.link.rtt_s"),
        (_sa(link={"latency": 0.1}), "secure_aggregation.link.latency"),
        (_sa(stage_timeout_s=0), "secure_aggregation.stage_timeout_s"),
        (_sa(stage_grace_s=-1), "secure_aggregation.stage_grace_s"),
        (
            {**_sa(), "aggregator": {"name": "fedavg", "robust": "median"}},
            "aggregator.robust 'median' needs individual updates",
        ),
        (
            {**_sa(), "aggregator": {"name": "qffl", "params": {"q": 1.0}}, "client": {"probe_loss": True}},
            "aggregator 'qffl' needs individual updates",
        ),
        ({**_sa(), "aggregator": {"name": "refl_saa"}}, "aggregator 'refl_saa' needs individual updates"),
        (
            {**_sa(), "aggregator": {"name": "fedavg", "clip_norm": 1.0}},
            "aggregator.clip_norm needs each update",
        ),
        ({**_sa(), "client": {"objective": "scaffold"}}, "client.objective 'scaffold' sends aux state"),
        ({**_sa(), "orchestrator": {"mode": "async"}}, "secagg_plus needs orchestrator.round_policy sync"),
        (
            {"secure_aggregation": {"protocol": "buffered"}, **SYNC},
            "buffered serves orchestrator.round_policy async",
        ),
        (
            {**_sa(), "privacy": {"mechanism": "central_gaussian"}, "aggregator": {"name": "fedavg"}},
            "privacy: aggregator.normalize 'weights' divides by a data-dependent sum",
        ),
    ],
)
def test_bad_secure_aggregation_settings_are_refused_in_one_line(raw: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert says in str(err.value)
    assert "\n" not in str(err.value).strip()


def test_secure_aggregation_is_off_by_default_and_left_out_of_the_written_config() -> None:
    cfg = validate({})
    assert not cfg.secure_aggregation.enabled
    assert "secure_aggregation" not in json.loads(cfg.model_dump_json())
    on = validate(_sa(group_size=20, num_shares=7))
    written = json.loads(on.model_dump_json())["secure_aggregation"]
    assert written["protocol"] == "secagg_plus" and on.secure_aggregation.t == 4
    assert validate({"secure_aggregation": {"protocol": "buffered"}}).secure_aggregation.enabled


@pytest.mark.parametrize("trace", ["90", "mobiperf"])
def test_secagg_comparisons_pair_each_strategy_with_and_without_secure_aggregation(trace: str) -> None:
    from felix.experiments.compare import load_comparison, variant_config

    comp = load_comparison(f"secagg-{trace}")
    assert comp.seeds == [0, 1, 2] and comp.reference == "felix"
    for name in ("felix", "felix-authors", "oort-async*", "oort*"):
        plain = variant_config(comp, name, {})
        secure = variant_config(comp, f"{name}+secagg", {})
        assert not plain.secure_aggregation.enabled
        want = "secagg_plus" if plain.orchestrator.round_policy == "sync" else "buffered"
        assert secure.secure_aggregation.protocol == want
        same = secure.model_copy(
            update={"secure_aggregation": plain.secure_aggregation, "strategy": plain.strategy}
        )
        assert same == plain


def test_felix_serve_refuses_secure_aggregation_with_adaptive_clipping(tmp_path: Any) -> None:
    """Deployed clients clip to a fixed norm; an adaptive one moves at the server, which cannot
    clip what it cannot see: refused in one line, before anything is made."""
    from felix.deploy.link import BrokerOptions
    from felix.deploy.server import ServeOptions, Server

    raw = {
        "secure_aggregation": {"protocol": "buffered"},
        "privacy": {"mechanism": "central_gaussian", "adaptive_clip": {"count_noise": 5.0}},
        "aggregator": {"normalize": "count"},
    }
    with pytest.raises(ConfigError, match="secure_aggregation with privacy.adaptive_clip"):
        Server(validate(raw), ServeOptions(BrokerOptions(), run_id="t", out_dir=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
