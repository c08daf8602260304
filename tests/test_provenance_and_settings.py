"""Settings YAML could mistype, trace offsets, and the provenance every summary carries."""

from __future__ import annotations

import numpy as np
import pytest

from felix.config import ConfigError, load_yaml, parse_set, validate
from felix.core.types import Tier
from felix.engine.run import resolve_config, run_config
from felix.scenario.traces import AvailabilityTrace, DeviceTrace


@pytest.mark.parametrize("text", ["3_75", "3_50", "2", "failures_48h"])
def test_trace_series_from_set_is_the_series_named(text: str) -> None:
    sets = parse_set(["trace.kind=mobiperf", "trace.path=t.json", f"trace.series={text}"])
    assert validate(sets).trace.series == text


def test_yaml_12_scalars() -> None:
    doc = load_yaml("a: 1_000\nb: 1e4\nc: on\nd: 0x10\ne: [1, 2.5, null, true]\nf: 1:30\n")
    assert doc == {"a": "1_000", "b": 1e4, "c": "on", "d": 16, "e": [1, 2.5, None, True], "f": "1:30"}


def test_number_given_for_a_string_setting_is_its_text() -> None:
    assert validate(parse_set(["name=2024"])).name == "2024"
    with pytest.raises(ConfigError, match="trace.series"):
        validate(parse_set(["trace.series=375"]))


def _trace(events: list[tuple[float, Tier]], period: float | None = None) -> DeviceTrace:
    return DeviceTrace.from_events(events, period, initial=events[0][1])


def test_offset_shifts_an_aperiodic_trace() -> None:
    d = _trace([(0, Tier.AVL_TRAIN), (300, Tier.UN_AVL), (1000, Tier.AVL_EVAL), (2000, Tier.AVL_TRAIN)])
    s = d.shifted(500)
    for t in [0, 1, 499, 500, 1499, 1500, 5000]:
        assert s.tier_at(t) == d.tier_at(t + 500), t
    assert s.next_change(0) == (500.0, Tier.AVL_EVAL)


def test_offset_rotates_a_periodic_trace() -> None:
    d = _trace(
        [(0, Tier.AVL_TRAIN), (100, Tier.UN_AVL), (250, Tier.AVL_TRAIN), (400, Tier.UN_AVL)], period=500
    )
    for off in [0, 50, 100, 260, 499, 500, 1234]:
        s = d.shifted(off)
        assert s.period == 500
        for t in np.arange(0, 1600, 7.0):
            assert s.tier_at(float(t)) == d.tier_at(float(t) + off), (off, t)


def test_offset_applies_to_every_device_and_rejects_negative() -> None:
    tr = AvailabilityTrace(
        (_trace([(0, Tier.AVL_TRAIN), (10, Tier.UN_AVL)]), _trace([(0, Tier.UN_AVL), (20, Tier.AVL_TRAIN)])),
        "t",
    )
    s = tr.shifted(15)
    assert [s.tier_at(k, 0) for k in range(2)] == [Tier.UN_AVL, Tier.UN_AVL]
    assert s.tier_at(1, 5) is Tier.AVL_TRAIN
    with pytest.raises(ValueError, match="offset"):
        tr.devices[0].shifted(-1)
    with pytest.raises(ConfigError, match="trace.offset_s"):
        validate(parse_set(["trace.offset_s=-5"]))


def test_summary_records_provenance() -> None:
    cfg = resolve_config(
        None, "fedbuff", parse_set(["partition.num_clients=8", "run.max_aggregations=2", "run.threads=1"])
    )
    prov = run_config(cfg, plots=False).summary["provenance"]
    import torch

    assert prov["torch"] == torch.__version__ and prov["torch_threads"] >= 1
    assert prov["run"]["threads"] == 1 and prov["run"]["device"] == "cpu"
    assert prov["felix_version"]
    assert prov["git"] is None or len(prov["git"]["commit"]) == 40
    # The CPU and the kernels torch dispatches to: the same seed rounds differently across them.
    assert prov["cpu"] and prov["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
