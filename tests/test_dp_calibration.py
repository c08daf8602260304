"""``benchmarks/dp_calibration.py`` writes the dp-* comparisons' variants: regenerated with each
family's settings (its buffer size and concurrency), the shipped files come back byte for byte, so
their noise multipliers are the script's and not edited by hand; and the rewrite touches only the
``variants:`` block."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def calib() -> ModuleType:
    pytest.importorskip("dp_accounting", reason="extra felix-fl[privacy] (dp-accounting) not installed")
    import dp_calibration

    return dp_calibration


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("dp-fmnist-90", []),
        ("dp-fsdd-mobiperf", ["--agg-goal", "50", "--concurrency", "150"]),
        (
            "dp-fsdd-mobiperf-banded",
            ["--agg-goal", "50", "--concurrency", "150", "--mechanism", "banded_mf", "--bands", "16"],
        ),
    ],
)
def test_the_shipped_dp_comparisons_are_the_scripts_output(
    calib: ModuleType, name: str, family: list[str]
) -> None:
    text = (calib.COMPARISONS / f"{name}.yaml").read_text()
    args = calib.parse_args(["--aggregations", "127", "--comparison", name, *family])
    lines = calib.variant_lines(args)
    assert len(lines) == 30
    assert calib.with_variants(text, lines) == text
    # another family's buffer size would change the file
    other = calib.parse_args(["--aggregations", "127", "--agg-goal", "7"])
    assert calib.with_variants(text, calib.variant_lines(other)) != text


def test_the_rewrite_replaces_only_the_variants_block(calib: ModuleType) -> None:
    text = 'name: x\nvariants:\n  "a": {strategy: fedavg}\n  # old\n  "b": {strategy: fedbuff}\nseeds: [0]\n'
    new = calib.with_variants(text, ['  "c": {strategy: felix}'])
    assert new == 'name: x\nvariants:\n  "c": {strategy: felix}\nseeds: [0]\n'
    with pytest.raises(ValueError, match="exactly one top-level 'variants:' block"):
        calib.with_variants("name: x\nseeds: [0]\n", [])


def test_banded_needs_its_bands_and_carries_less_noise(calib: ModuleType) -> None:
    for argv in (
        ["--mechanism", "banded_mf"],
        ["--bands", "16"],
        ["--mechanism", "banded_mf", "--bands", "0"],
    ):
        with pytest.raises(SystemExit):
            calib.parse_args(["--aggregations", "127", *argv])
    tree = calib.calibrate(8.0, 127, 1e-5, 5, None)
    banded = calib.calibrate(8.0, 127, 1e-5, 5, None, "banded_mf", 16)
    assert tree == 7.3  # the dp-* families' fedbuff rows at epsilon 8
    assert 1.0 < banded < tree / 2  # 16 bands: a smaller multiplier, but above b = 1's
    one_band = calib.calibrate(8.0, 127, 1e-5, 5, None, "banded_mf", 1)
    assert one_band < banded
