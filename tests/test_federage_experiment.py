"""``felix federage-compare``: the shipped comparison file run by the one engine, end to end on the
bundled 8x8 digits (seconds on CPU), and the engine options it relies on (RAM trace, rare-clients
partition, FedeRage's fixed mini-batch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from felix.cli import main as felix_main
from felix.cli.seeds import parse_seeds
from felix.experiments.compare import load_comparison, variant_config
from felix.experiments.federage import add_parser, main, paired_delta_table
from felix.experiments.shipped import COMPARISONS

VARIANTS = [
    "fedavg",
    "fedprox",
    "scaffold",
    "qffl",
    "federage-paper-a0.1-g0.5",
    "federage-capped-a0.1-g0.5",
    "federage-capped-a0.5-g0.5",
]
#: The shipped scenario at digits size: 8 clients (2 rare), 3 RAM rounds of 60 s.
SMALL_SETS = [
    "dataset.name=digits",
    "partition.num_clients=8",
    "partition.head_per_class=60",
    "partition.min_samples=8",
    "orchestrator.agg_goal=8",
    "trace.horizon_s=180",
    "run.max_time_s=180",
    "client.batch_size=8",
    "client.max_steps=2",
    "trace.ram.p_frequent=0.6",
    "trace.ram.p_rare=0.3",
    "run.rare_p=0.3",
]
SMALL = [a for s in SMALL_SETS for a in ("--set", s)] + ["--seeds", "0", "-q"]


def small_sets() -> dict:
    from felix.config import parse_set

    return parse_set(SMALL_SETS)


def test_the_file_lists_the_methods_of_the_old_catalogue() -> None:
    comp = load_comparison(COMPARISONS / "federage.yaml")
    assert list(comp.variants) == VARIANTS and comp.seeds == [0, 1, 2] and comp.reference == "fedavg"
    cfgs = {v: variant_config(comp, v, {}, 0) for v in VARIANTS}
    assert cfgs["fedavg"].trace.kind == "ram" and cfgs["fedavg"].orchestrator.round_policy == "sync"
    assert cfgs["scaffold"].client.objective == "scaffold"
    assert cfgs["qffl"].aggregator.name == "qffl" and cfgs["qffl"].client.probe_loss
    assert cfgs["fedprox"].client.objective_params == {"mu": 0.01}
    fr = cfgs["federage-paper-a0.1-g0.5"].client
    assert fr.objective == "federage" and fr.objective_params["step_rule"] == "paper"
    assert all(c.run.per_client_eval for c in cfgs.values())


def test_federage_compare_writes_table_json_and_plot(tmp_path: Path) -> None:
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "federage_compare.json").read_text())
    assert [r["method"] for r in doc["summary"]] == VARIANTS
    for row in doc["summary"]:
        assert 0.0 <= row["worst_client_acc"] <= row["bottom10_acc"] <= row["mean_client_acc"] <= 1.0
        assert 0.0 <= row["minority_f1"] <= 1.0 and 0.0 <= row["macro_f1"] <= 1.0
    run0 = doc["runs"][0][0]
    assert (
        len(run0["client_acc"]) == 8 and run0["rare_clients"] == [6, 7] and len(run0["per_class_acc"]) == 10
    )
    assert run0["aggregations"] >= 1
    prov = doc["provenance"]
    assert prov["torch"] == torch.__version__
    assert prov["git"] is None or len(prov["git"]["commit"]) == 40
    assert all(row["finite_seeds"] == 1 for row in doc["summary"])
    assert "| fedavg |" in (tmp_path / "federage_compare.md").read_text()
    assert (tmp_path / "client_accuracy.png").stat().st_size > 0
    assert (tmp_path / "runs" / "scaffold" / "seed-0" / "summary.json").exists()


def test_deterministic_by_seed(tmp_path: Path) -> None:
    args = SMALL + ["--variants", "fedavg,federage-capped-a0.1-g0.5"]
    main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "federage_compare.json").read_text())["runs"] for d in "ab")
    assert [r["client_acc"] for r in a[0]] == [r["client_acc"] for r in b[0]]


def test_add_parser_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="felix")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["federage-compare", "--seeds", "0", "1", "--variants", "fedavg"])
    assert args.command == "federage-compare" and parse_seeds(args.seeds) == [0, 1] and callable(args.func)
    assert args.file == COMPARISONS / "federage.yaml"


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--variants", "fedavg,fedavgg"], "'fedavgg' is not a variant"),
        (
            [
                "--variants",
                "federage-capped-a0.1-g0.5",
                "--set",
                "client.objective_params={alpha: 0, gamma: 0.5}",
            ],
            "federage alpha must lie in (0, 1]",
        ),
        (
            [
                "--set",
                "client.objective_params={alpha: 0.1, gamma: 0.5, step_rule: exact}",
                "--variants",
                "federage-paper-a0.1-g0.5",
            ],
            "step_rule must be one of",
        ),
        (["--set", "run.rare_p=2"], "run.rare_p"),
        (["--set", "trace.ram.p_rare=0.9"], "need p_rare <= p_frequent"),
    ],
)
def test_felix_cli_answers_bad_input_without_a_traceback(
    bad: list[str], message: str, capsys, tmp_path: Path
) -> None:
    assert felix_main(["federage-compare", *SMALL, "--out", str(tmp_path), *bad]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.startswith("federage-compare: error:") and err.count("\n") == 1


def test_federage_trains_on_full_model_batches_only() -> None:
    """FedeRage fixes the model mini-batch b (drop_last); the baselines keep the short last batch."""
    from felix.engine.plan import plan_run

    comp = load_comparison(COMPARISONS / "federage.yaml")
    fr = variant_config(comp, "federage-capped-a0.1-g0.5", small_sets(), 0)
    ce = variant_config(comp, "fedavg", small_sets(), 0)
    assert plan_run(fr).trainers.trainer().cfg.drop_last and not plan_run(ce).trainers.trainer().cfg.drop_last


def test_rare_clients_scenario_holds_rare_classes_at_rare_clients() -> None:
    from felix.engine.components import per_client_setup
    from felix.scenario.build import _stream, build_population
    from felix.scenario.random_access import ram_probabilities

    cfg = variant_config(load_comparison(COMPARISONS / "federage.yaml"), "fedavg", small_sets(), 0)
    pop = build_population(cfg)
    counts = np.stack([d.class_counts(10).numpy() for d in pop.client_data])
    p = ram_probabilities(cfg.trace, 8, _stream(0, 1), counts)
    rare = p <= 0.3
    assert rare.tolist() == [False] * 6 + [True] * 2  # the last quarter: the rare classes' holders
    setup = per_client_setup(cfg, None, counts)  # type: ignore[arg-type]  # a RAM needs no trace here
    tail = setup.tail_classes
    assert len(tail) == 2 and set(tail) == set(np.argsort(counts.sum(axis=0))[:2])
    held = counts[:, tail].sum(axis=1)
    assert (held[~rare] == 0).all() and (held[rare] > 0).all()  # only rare clients hold the rare classes
    assert counts[rare].sum() > held[rare].sum()  # and a share of the common classes too
    assert (counts.sum(axis=1) >= 8).all()
    totals = counts.sum(axis=0)
    assert totals.max() == 60 and totals.min() == 12  # long tail: head 60, head/tail 5


def test_paired_delta_table() -> None:
    def res(name: str, acc: float) -> dict:
        return {
            "method": name,
            "mean_client_acc": acc,
            "bottom10_acc": acc,
            "rare_client_acc": acc,
            "tail_class_acc": acc,
            "global_acc": acc,
        }

    runs = [
        [res("fedavg", 0.7), res("x", 0.75)],
        [res("fedavg", 0.8), res("x", 0.79)],
        [res("fedavg", 0.6), res("x", 0.62)],
    ]
    table = paired_delta_table(runs)
    # differences +0.05, -0.01, +0.02: mean +0.020, sample std 0.030, ahead on 2 of 3 seeds
    assert "| x | +0.020 ± 0.030 (2/3) |" in table and "| fedavg |" not in table
    assert paired_delta_table(runs, reference="nope") == ""


@pytest.mark.slow
def test_three_seeds_give_a_spread(tmp_path: Path) -> None:
    args = [a for a in SMALL if a not in ("--seeds", "0")] + [
        "--seeds",
        "0",
        "1",
        "2",
        "--variants",
        "fedavg,scaffold",
    ]
    assert main(args + ["--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "federage_compare.json").read_text())
    assert len(doc["runs"]) == 3 and doc["summary"][0]["mean_client_acc_std"] > 0


def test_a_rerun_reads_finished_runs_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An interrupted sweep resumes: a run whose folder holds a finished run of the same config is
    read back (same figures), ``--force`` reruns it, a different config in the folder is refused."""
    args = SMALL[:-1] + ["--variants", "fedavg", "--out", str(tmp_path)]  # progress lines on
    assert main(args) == 0
    first = json.loads((tmp_path / "federage_compare.json").read_text())["runs"]
    assert (tmp_path / "runs" / "fedavg" / "seed-0" / "config.json").exists()
    capsys.readouterr()
    assert main(args) == 0
    assert "fedavg seed 0 done (finished before, read back)" in capsys.readouterr().err
    assert json.loads((tmp_path / "federage_compare.json").read_text())["runs"] == first
    assert main(args + ["--force"]) == 0
    assert "read back" not in capsys.readouterr().err
    assert main(args + ["--set", "client.lr=0.2"]) == 2
    assert "holds a finished run of a different config" in capsys.readouterr().err


def test_the_sweep_file_has_every_alpha_gamma_rule() -> None:
    comp = load_comparison("federage-sweep")
    assert comp.seeds == [0, 1, 2] and comp.reference == "fedavg"
    rules = {
        (p["alpha"], p["gamma"], p["step_rule"] + ("-cap1.5" if p.get("weight_cap") == 1.5 else ""))
        for v in comp.variants
        if (p := variant_config(comp, v, {}, 0).client.objective_params).get("step_rule")
    }
    grid = {
        (a, g, r)
        for a in (0.05, 0.1, 0.2, 0.3, 0.5)
        for g in (0.5, 1.0)
        for r in ("paper", "capped", "balanced", "balanced-cap1.5")
    }
    assert rules == grid | {(0.1, 0.5, "normalised"), (0.1, 1.0, "normalised")}
    assert list(comp.variants)[:4] == ["fedavg", "fedprox", "scaffold", "qffl"]


def test_the_seeds_file_repeats_sweep_variants_on_eight_seeds() -> None:
    """federage-seeds.yaml's variants are the sweep's, config for config, so its seeds 0-2 are the
    sweep's runs (docs/federage.md, "Alpha 0.1 over eight seeds")."""
    seeds, sweep = load_comparison("federage-seeds"), load_comparison("federage-sweep")
    assert seeds.seeds == list(range(8)) and seeds.reference == "fedavg"
    for v in seeds.variants:
        assert v in sweep.variants
        assert variant_config(seeds, v, {}, 5) == variant_config(sweep, v, {}, 5)
