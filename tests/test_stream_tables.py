"""``benchmarks/stream_tables.py`` on a hand-made compare folder: the step-curve averages over a
window, the recovery that did not happen counted as the time left, the variant names from the
manifest, the paired differences to the reference, and the overview of several comparisons. The
docs' stream tables are built by it, so their arithmetic is checked here rather than trusted."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def tables() -> ModuleType:
    import stream_tables

    return stream_tables


def _run(
    folder: Path, seed: int, curve: list[tuple[float, float]], age: float, mb: float, recovered: bool
) -> None:
    """One run's files, as ``felix compare`` writes them, with an accuracy step curve and a surge
    at 1000 s that ends at 2000 s, in a 3000 s run."""
    folder.mkdir(parents=True)
    rows = "time_s,accuracy\n" + "".join(f"{t},{a}\n" for t, a in curve)
    (folder / "evaluations.csv").write_text(rows)
    summary: dict[str, Any] = {
        "seed": seed,
        "virtual_time_s": 3000.0,
        "final_accuracy": curve[-1][1],
        "bytes_down": mb * 1e6 / 2,
        "bytes_up": mb * 1e6 / 2,
        "aggregations": 10,
        "stop_reason": "max_time",
        "diagnostics": {"staleness_mean": 2.0, "dropped_share": 0.01},
        "stream": {
            "time_avg_accuracy": float(np.mean([a for _, a in curve])),
            "time_avg_uniform_accuracy": 0.5,
            "data_age_mean_s": age,
            "shifts": [
                {
                    "at_s": 1000.0,
                    "kind": "surge",
                    "level_before": 0.8,
                    "recovery_s": 300.0 if recovered else None,
                },
                {"at_s": 2000.0, "kind": "surge_end", "level_before": 0.7, "recovery_s": 0.0},
            ],
        },
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def test_window_average_holds_each_evaluation_until_the_next(tables: ModuleType) -> None:
    t = np.array([0.0, 100.0, 300.0])
    a = np.array([0.2, 0.6, 1.0])
    # [50, 200]: 0.2 for 50 s, 0.6 for 100 s.
    assert tables.window_average(t, a, 50.0, 200.0) == pytest.approx((0.2 * 50 + 0.6 * 100) / 150)
    # [100, 400]: 0.6 for 200 s, 1.0 for 100 s (the evaluation at the window's start counts from it).
    assert tables.window_average(t, a, 100.0, 400.0) == pytest.approx((0.6 * 200 + 1.0 * 100) / 300)
    assert tables.window_average(t, a, -10.0, 50.0) is None


def test_folder_to_tables_paired_and_overview(
    tables: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cmp"
    manifest: dict[str, Any] = {
        "runs": {},
        "command": ["felix", "compare"],
        "provenance": {"cpu": "AMD EPYC"},
    }
    for variant, folder, shift in (
        ("felix", "felix", 0.0),
        ("oort-async*", "oort-async-oracle", -0.1),
        ("oort-async", "oort-async", -0.2),
    ):
        for seed in (0, 1, 2):
            curve = [(0.0, 0.5 + shift), (1000.0, 0.7 + shift + 0.01 * seed), (2000.0, 0.9 + shift)]
            _run(
                out / folder / f"seed-{seed}",
                seed,
                curve,
                100.0 + 10 * seed - 100 * shift,
                10.0 * (1 + seed),
                seed != 1,
            )
            manifest["runs"][f"{variant}/seed={seed}"] = {
                "variant": variant,
                "seed": seed,
                "folder": f"{folder}/seed-{seed}",
            }
    (out / "manifest.json").write_text(json.dumps(manifest))
    dest = tmp_path / "res" / "cmp"
    monkeypatch.setattr(sys, "argv", ["stream_tables.py", str(out), "--out", str(dest)])
    tables.main()
    doc = json.loads(dest.with_suffix(".json").read_text())
    assert set(doc["stats"]) == {"felix", "oort-async*", "oort-async"}
    assert doc["provenance"] == {"cpu": "AMD EPYC"}
    felix = doc["stats"]["felix"]
    # From the surge (1000 s) to the end (3000 s): 0.7 (+0.01 seed) for 1000 s, then 0.9.
    assert felix["time_avg_accuracy_after_shift"][0] == pytest.approx(0.80 + 0.005 * 1)
    assert felix["acc_during_surge"][0] == pytest.approx(0.71)
    assert felix["acc_during_surge_end"][0] == pytest.approx(0.9)
    # Seed 1 did not recover from the surge: it counts as the 1000 s left before the surge ends.
    assert felix["recovery_surge_s"][0] == pytest.approx((300 + 1000 + 300) / 3)
    assert felix["not_recovered_surge"] == 1
    paired = doc["stats"]["oort-async*"]["paired_time_avg_accuracy"]
    assert paired["mean"] == pytest.approx(-0.1)
    assert paired["std"] == pytest.approx(0.0, abs=1e-12)
    assert (paired["higher"], paired["seeds"]) == (0, 3)
    assert doc["stats"]["oort-async*"]["paired_data_age_mean_s"]["mean"] == pytest.approx(10.0)
    assert doc["stats"]["oort-async*"]["paired_total_mb"]["mean"] == pytest.approx(1.0)
    # The one contrast whose variants both ran: the oracle's effect, +0.1 on every seed.
    [contrast] = doc["contrasts"]
    assert (contrast["variant"], contrast["against"]) == ("oort-async*", "oort-async")
    assert contrast["paired"]["time_avg_accuracy"]["mean"] == pytest.approx(0.1)
    assert contrast["paired"]["time_avg_accuracy"]["higher"] == 3
    md = dest.with_suffix(".md").read_text()
    assert "| oort-async* − oort-async | an availability oracle" in md
    assert "| oort-async* | 3 | -0.1000 ± 0.0000 (0/3)" in md
    assert "533 ± 404 (1 not)" in md
    assert dest.with_suffix(".png").is_file()

    monkeypatch.setattr(
        sys,
        "argv",
        ["stream_tables.py", "--overview", str(dest.with_suffix(".json")), "--out", str(tmp_path / "ov")],
    )
    tables.main()
    ov = (tmp_path / "ov.md").read_text()
    assert "| oort-async* | 0.6033 ± 0.0033 (-0.1000, 0/3) |" in ov

    # The same comparison against a twin whose every accuracy is 0.05 lower (one setting changed):
    # +0.05 on every seed and variant; a twin from another CPU vendor is said so above the table.
    twin = json.loads(dest.with_suffix(".json").read_text())
    twin["comparison"], twin["provenance"] = "cmp-twin", {"cpu": "Intel Xeon"}
    for rows in twin["runs"].values():
        for r in rows:
            r["time_avg_accuracy"] -= 0.05
    (tmp_path / "twin.json").write_text(json.dumps(twin))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "stream_tables.py",
            "--between",
            str(dest.with_suffix(".json")),
            str(tmp_path / "twin.json"),
            "--out",
            str(tmp_path / "between"),
        ],
    )
    tables.main()
    lines = (tmp_path / "between.md").read_text().splitlines()
    assert "made on different CPUs (AMD EPYC, Intel Xeon)" in lines[0]
    assert [ln.split(" | ")[:3] for ln in lines[4:]] == [
        [f"| {v}", "3", "+0.0500 ± 0.0000 (3/3)"] for v in ("felix", "oort-async*", "oort-async")
    ]
