"""Multi-seed, multi-target comparison statistics and plots."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from felix.metrics.multiseed import Spread, compare_seeds, first_hits, plot_comparison, table_markdown
from felix.metrics.recorder import EvalRow


def _rows(accs: list[float], dt: float = 10.0, mb_per_step: int = 1_000_000) -> list[EvalRow]:
    return [EvalRow(i * dt, i, a, 0.0, i * mb_per_step, i * mb_per_step, 0) for i, a in enumerate(accs)]


def test_first_hits_use_the_window_rule() -> None:
    rows = _rows([0.1, 0.5, 0.81, 0.79, 0.83, 0.85, 0.86])
    hits = first_hits(rows, [0.8, 0.84, 0.9], window=2)
    # window 2 at 0.8: mean(0.81, 0.79) = 0.80 but the last is below; (0.79, 0.83) mean 0.81 and last >= -> row 4
    assert hits[0.8] is not None and hits[0.8].time_s == 40.0 and hits[0.8].version == 4
    assert hits[0.84] is not None and hits[0.84].time_s == 50.0  # mean(0.83, 0.85) = 0.84
    assert hits[0.9] is None


def test_spread_counts_seeds_that_reached() -> None:
    s = Spread.of_values([10.0, None, 20.0])
    assert (s.mean, s.n, s.of) == (15.0, 2, 3)
    assert s.std == pytest.approx(math.sqrt(50.0))
    assert "2/3 reached" in s.text()
    assert Spread.of_values([None, None]).text() == "not reached (0/2)"


def test_speedup_is_paired_by_seed() -> None:
    curves = {
        "felix": {0: _rows([0.0, 0.9, 0.9]), 1: _rows([0.0, 0.0, 0.9, 0.9])},
        "oort": {0: _rows([0.0, 0.0, 0.0, 0.9, 0.9]), 1: _rows([0.0, 0.0, 0.0, 0.0, 0.0])},
    }
    stats = compare_seeds(curves, [0.8], window=1, reference="felix")
    a = stats["oort"][0.8]
    assert a.time_s.mean == 30.0 and a.time_s.n == 1
    assert (
        a.speedup_of_reference.mean == 3.0
        and a.speedup_of_reference.n == 1
        and a.speedup_of_reference.of == 2
    )
    assert stats["felix"][0.8].time_s.mean == 15.0
    md = table_markdown(stats, "felix", "test")
    assert "| oort | 30 ± 0 (1/2 reached)" in md
    with pytest.raises(ValueError, match="reference"):
        compare_seeds(curves, [0.8], 1, "nope")


def test_plots_zoom_to_the_race(tmp_path: Path) -> None:
    curves = {
        "fast": {0: _rows([0.0, 0.9, 0.9]), 1: _rows([0.0, 0.5, 0.9])},
        "never": {0: _rows([0.1] * 5000), 1: _rows([0.2] * 5000)},
    }
    stats = compare_seeds(curves, [0.8, 0.85], window=1, reference="fast")
    paths = plot_comparison(tmp_path, curves, stats)
    assert [p.name for p in paths] == [
        "comparison_accuracy_vs_time.png",
        "comparison_time_to_target.png",
        "comparison_bytes_to_target.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)
    from felix.metrics.multiseed import time_axis_limit

    assert time_axis_limit(stats, curves) == 2 * 15.0  # the 'never' run's 50,000 s is not the axis


def test_the_summary_splits_bytes_into_train_and_eval() -> None:
    """Eval traffic is part of the result: MB to each target, then of it the training and the
    evaluation tasks' MB (the rest is control)."""

    def rows(eval_mb: int) -> list[EvalRow]:
        accs = [0.0, 0.5, 0.9]
        return [
            EvalRow(10.0 * i, i, a, 0.0, i * 4_000_000, 0, 0, i * 3_000_000, i * eval_mb * 1_000_000)
            for i, a in enumerate(accs)
        ]

    curves = {"felix": {0: rows(1), 1: rows(1)}, "fedbuff": {0: rows(0), 1: rows(0)}}
    stats = compare_seeds(curves, [0.8], window=1, reference="felix")
    a = stats["felix"][0.8]
    assert (a.bytes_total.mean, a.bytes_train.mean, a.bytes_eval.mean) == (8e6, 6e6, 2e6)
    md = table_markdown(stats, "felix", "test")
    assert "| MB to 0.8 | train MB to 0.8 | eval MB to 0.8 |" in md
    assert (
        "| felix | 20 ± 0 [20-20] | 8.0 ± 0.0 [8.0-8.0] | 6.0 ± 0.0 [6.0-6.0] | 2.0 ± 0.0 [2.0-2.0] | - |"
        in md
    )
    assert (
        "| fedbuff | 20 ± 0 [20-20] | 8.0 ± 0.0 [8.0-8.0] | 6.0 ± 0.0 [6.0-6.0] | 0.0 ± 0.0 [0.0-0.0] |" in md
    )
