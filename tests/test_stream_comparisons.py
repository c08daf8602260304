"""The stream-* comparison files: each variant is its strategy preset on the file's scenario with the
file's stream, the FedBuff family over the sum of its weights (the step TierFuse takes, so that the
async variants differ in orchestration, not in server step), the data-age variant FeLiX with that one
option, and the files that say "no delay" or "gradual" differ from the abrupt one in that alone."""

from __future__ import annotations

from typing import Any

import pytest

from felix.engine.setup import resolve_config
from felix.experiments.compare import load_comparison, variant_config

FEDBUFF_FAMILY = ("fedbuff", "oort-async", "oort-async*", "felix-no-tierfuse")
EIGHT = ("oort", "oort*", "oort-async", "oort-async*", "refl*", "fedbuff", "fedavg", "felix")
FMNIST = [
    "stream-fmnist-abrupt",
    "stream-fmnist-gradual",
    "stream-fmnist-abrupt-nodelay",
    "stream-fmnist-gradual-nodelay",
]


def _plain(comp_name: str, variant: str, strategy: str, extra: dict[str, Any]) -> Any:
    """The variant as its preset on the scenario with the file's base (no comparison machinery)."""
    comp = load_comparison(comp_name)
    base = variant_config(comp, "felix", {}, 1)
    over: dict[str, Any] = {
        "seed": 1,
        "run": base.run.model_dump(),
        "stream": base.stream.model_dump(),
        "trace": {"offset_s": base.trace.offset_s},
        **extra,
    }
    return resolve_config(None, strategy, over, base.name)


@pytest.mark.parametrize("name", FMNIST)
def test_fmnist_stream_files_run_the_eight_strategies_and_two_felix_variants(name: str) -> None:
    comp = load_comparison(name)
    assert comp.reference == "felix" and comp.seeds == [0, 1, 2]
    assert set(EIGHT) | {"felix-no-tierfuse", "felix-fresh"} == set(comp.variants)
    for v in comp.variants:
        cfg = variant_config(comp, v, {}, 1)
        assert cfg.stream.enabled and cfg.run.max_time_s == 7200.0
        if v == "felix-fresh":
            extra: dict[str, Any] = {
                "aggregator": {"params": {"freshness": "data_age", "age_half_life_s": 600.0}}
            }
            strategy = "felix"
        else:
            extra = {"aggregator": {"normalize": "weights"}} if v in FEDBUFF_FAMILY else {}
            strategy = v
        assert cfg.model_copy(update={"strategy": strategy}) == _plain(name, v, strategy, extra)
        if v in FEDBUFF_FAMILY:
            assert cfg.aggregator.normalize == "weights"


def test_fmnist_stream_files_differ_in_drift_and_delay_only() -> None:
    cfgs = {n: variant_config(load_comparison(n), "felix", {}, 0) for n in FMNIST}
    abrupt = cfgs["stream-fmnist-abrupt"]
    assert abrupt.stream.labels.delay == "lognormal"
    for n, cfg in cfgs.items():
        delay = "none" if n.endswith("nodelay") else "lognormal"
        assert cfg.stream.labels.delay == delay
        kinds = {s.kind for s in cfg.stream.drift.shifts}
        assert kinds == ({"rotate"} if "gradual" in n else {"surge"})
        same = abrupt.stream.model_copy(update={"labels": cfg.stream.labels, "drift": cfg.stream.drift})
        assert cfg.stream == same and cfg.model_copy(update={"stream": abrupt.stream}) == abrupt


@pytest.mark.parametrize(
    ("name", "scenario"),
    [("stream-mobiperf-abrupt", "felix-cpu-mobiperf"), ("stream-speech-abrupt", "felix-speech-cpu")],
)
def test_other_stream_files_run_the_same_variants_on_their_scenario(name: str, scenario: str) -> None:
    comp = load_comparison(name)
    abrupt = variant_config(load_comparison("stream-fmnist-abrupt"), "felix", {}, 0)
    assert set(EIGHT) | {"felix-no-tierfuse", "felix-fresh"} == set(comp.variants)
    for v in comp.variants:
        cfg = variant_config(comp, v, {}, 0)
        assert cfg.name == scenario and cfg.trace.offset_s == 300.0
        assert cfg.stream == abrupt.stream
        assert cfg.aggregator.normalize == (
            "weights" if v in FEDBUFF_FAMILY else resolve_config(None, cfg.strategy, {}).aggregator.normalize
        )
