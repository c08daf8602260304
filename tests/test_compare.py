"""`felix compare` and the strategy presets of the FeLiX paper's Table 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from felix.cli import main
from felix.engine.setup import resolve_config
from felix.experiments.compare import load_comparison
from felix.presets import MAIN_STRATEGIES, STRATEGIES

TINY = [
    "--set",
    "partition.num_clients=12",
    "--set",
    "model=mlp",
    "--set",
    "run.max_aggregations=3",
    "--set",
    "run.target_accuracy=0.3",
    "--set",
    "run.target_window=1",
    "--set",
    "run.stop_at_target=false",
    "--set",
    "orchestrator.concurrency=4",
    "--set",
    "orchestrator.agg_goal=2",
    "--set",
    "trace.kind=always",
]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_preset_validates_and_builds(name):
    from felix.engine.components import build_orchestrator
    from felix.scenario.build import build_trace

    cfg = resolve_config(None, name, {})
    import numpy as np

    orch = build_orchestrator(cfg, np.zeros(3, np.float32), build_trace(cfg))
    assert orch.cfg.round_policy == cfg.orchestrator.round_policy


def test_table1_axes():
    felix = resolve_config(None, "felix", {})
    assert (felix.orchestrator.round_policy, felix.orchestrator.availability) == ("async", "tiertrack")
    assert (felix.selector.name, felix.eval_selector.name, felix.aggregator.name) == (
        "oort",
        "tierselect",
        "tierfuse",
    )
    assert felix.aggregator.server_lr == 0.3
    oort = resolve_config(None, "oort", {})
    assert (
        oort.orchestrator.round_policy,
        oort.orchestrator.availability,
        oort.orchestrator.task_timeout_s,
    ) == (
        "sync",
        "none",
        None,
    )
    assert resolve_config(None, "oort*", {}).orchestrator.availability == "oracle"
    assert resolve_config(None, "oort-async*", {}).orchestrator.availability == "oracle"
    refl = resolve_config(None, "refl*", {})
    assert (refl.selector.name, refl.aggregator.name, refl.orchestrator.availability) == (
        "refl_ips",
        "refl_saa",
        "oracle",
    )
    assert resolve_config(None, "felix-no-tierfuse", {}).aggregator.name == "fedbuff"
    assert resolve_config(None, "felix-no-eval", {}).eval_selector.name == "none"
    assert len(MAIN_STRATEGIES) == 7


def test_compare_runs_strategies_on_the_same_scenario(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--strategies", "fedbuff,felix,oort*", "--out", str(out), *TINY])
    assert rc == 0
    doc = json.loads((out / "comparison.json").read_text())
    assert set(doc["strategies"]) == {"fedbuff", "felix", "oort*"} and doc["reference"] == "felix"
    summaries = doc["strategies"]
    for s in summaries.values():
        assert s["aggregations"] == 3
    # Same partition and initial model: the version-0 evaluation is identical for all strategies.
    first = {
        (out / name / "evaluations.csv").read_text().splitlines()[1]
        for name in ("fedbuff", "felix", "oort-oracle")
    }
    assert len(first) == 1
    md = (out / "comparison.md").read_text()
    assert "| felix |" in md and "speed-up of felix" in md
    for png in (
        "comparison_accuracy_vs_time.png",
        "comparison_accuracy_vs_bytes.png",
        "comparison_time_to_target.png",
        "comparison_bytes.png",
    ):
        assert (out / png).stat().st_size > 1000
    assert summaries["felix"]["bytes_by_kind"]["down"]["eval"] > 0  # TierSelect probes
    assert summaries["fedbuff"]["bytes_by_kind"]["down"]["eval"] == 0  # no eval tasks without TierSelect


def test_result_files_record_a_portable_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """comparison.json / manifest.json name a shipped file by its package path, a file under the
    working directory relative to it, any other file by its name: no path of the machine."""
    from felix.experiments.compare import portable_source

    shipped = load_comparison("felix-cpu-100").source
    assert portable_source(shipped) == "felix/configs/comparisons/felix-cpu-100.yaml"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    assert portable_source(str(tmp_path / "mine" / "c.yaml")) == "mine/c.yaml"
    assert portable_source("/elsewhere/c.yaml") == "c.yaml"
    assert portable_source("command line") == "command line"
