"""End-to-end smoke run of ``felix federage-compare`` on the bundled 8x8 digits (seconds on CPU)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from felix.cli import main as felix_main
from felix.experiments.federage import Method, add_parser, local_steps, main, parse_federage, train_config

SMALL = ["--dataset", "digits", "--model", "mlp", "--clients", "8", "--rounds", "3", "--head-per-class", "60",
         "--imbalance", "5", "--batch-size", "8", "--max-steps", "2", "--federage", "0.5:0.5", "--q", "1", "-q"]


def test_federage_compare_writes_table_json_and_plot(tmp_path: Path) -> None:
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "federage_compare.json").read_text())
    names = [r["method"] for r in doc["summary"]]
    assert names == ["fedavg", "fedprox(mu=0.01)", "scaffold", "qffl(q=1)",
                     "fedavg-ips(oracle)", "federage-capped(a=0.5,g=0.5)"]
    for row in doc["summary"]:
        assert 0.0 <= row["worst_client_acc"] <= row["bottom10_acc"] <= row["mean_client_acc"] <= 1.0
    assert len(doc["runs"][0][0]["client_acc"]) == 8
    assert "paired_overhead" in doc["scenarios"][0]
    prov = doc["provenance"]
    assert prov["torch"] == torch.__version__ and prov["run"]["torch_threads_per_process"] == 1
    assert prov["git"] is None or len(prov["git"]["commit"]) == 40
    assert all(row["finite_seeds"] == 1 for row in doc["summary"])  # 3 rounds: even SCAFFOLD stays finite
    assert "| fedavg |" in (tmp_path / "federage_compare.md").read_text()
    assert (tmp_path / "client_accuracy.png").stat().st_size > 0


def test_deterministic_by_seed(tmp_path: Path) -> None:
    args = SMALL + ["--methods", "fedavg,federage"]
    main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "federage_compare.json").read_text())["runs"] for d in "ab")
    assert [r["client_acc"] for r in a[0]] == [r["client_acc"] for r in b[0]]


def test_add_parser_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="felix")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["federage-compare", "--rounds", "5", "--methods", "fedavg"])
    assert args.command == "federage-compare" and args.rounds == 5 and callable(args.func)


def test_bad_arguments_are_reported(capsys) -> None:
    assert main(SMALL + ["--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(SMALL + ["--federage", "0.5"]) == 2


@pytest.mark.parametrize("bad, message", [
    (["--federage", "0:0.5"], "federage alpha must lie in (0, 1]"),
    (["--methods", "fedavg,fedavgg"], "unknown method 'fedavgg'"),
    (["--federage", "0.1:0.5:exact"], "step rule must be one of"),
    (["--rare-p", "2"], "--rare-p must lie in [0, 1]"),
])
def test_felix_cli_answers_bad_input_without_a_traceback(bad: list[str], message: str, capsys) -> None:
    assert felix_main(["federage-compare", *SMALL, *bad]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("federage-compare: error:")


def test_parse_federage_rules() -> None:
    assert parse_federage("0.5:0.5, 0.1:1:paper", "normalised") == [(0.5, 0.5, "normalised"), (0.1, 1.0, "paper")]
    assert parse_federage("0.2:0.5", "paper") == [(0.2, 0.5, "paper")]


def test_federage_trains_on_full_model_batches_only() -> None:
    """FedeRage fixes the model mini-batch b (drop_last); the baselines keep the short last batch."""
    args = argparse.Namespace(lr=0.05, batch_size=16, epochs=2, max_steps=None)
    fr = train_config(args, Method("f", "federage", {"alpha": 0.2, "gamma": 0.5}))
    ce = train_config(args, Method("c", "ce"))
    assert fr.drop_last and not ce.drop_last
    assert local_steps(40, fr) == 4 and local_steps(40, ce) == 6  # 2 epochs of 2 (+1 short) batches
    assert not train_config(args, Method("f", "federage", {"fixed_batch": False})).drop_last


def test_rare_clients_survive_ties(tmp_path) -> None:
    """Two participation levels with 75%+ frequent clients: only the rare level counts as rare."""
    out = tmp_path / "tl"
    assert main(SMALL + ["--methods", "fedavg", "--p-dist", "two-level", "--frequent-fraction", "0.75",
                         "--p-frequent", "0.3", "--p-rare", "0.03", "--out", str(out)]) == 0
    sc = json.loads((out / "federage_compare.json").read_text())["scenarios"][0]
    assert sc["rare_clients"] == 2 and sc["rare_client_p_max"] == pytest.approx(0.03)  # 8 clients: a quarter
    assert np.isfinite(sc["p_max"])


def test_rare_clients_scenario_holds_rare_classes_at_rare_clients() -> None:
    from felix.experiments.federage import _configure, build_scenario

    parser = argparse.ArgumentParser()
    _configure(parser)
    args = parser.parse_args(SMALL + ["--scenario", "rare-clients", "--p-frequent", "0.3", "--p-rare", "0.03"])
    sc = build_scenario(args, seed=0)
    rare = sc.probabilities <= 0.03
    assert rare.sum() == 2 and sc.rare_p == 0.03 and len(sc.rare_classes) == 2
    assert set(sc.rare_classes) == set(sc.class_order[-2:].tolist())
    held = sc.counts[:, sc.rare_classes].sum(axis=1)
    assert (held[~rare] == 0).all() and (held[rare] > 0).all()  # only rare clients hold the rare classes
    assert sc.counts[rare].sum() > held[rare].sum()  # and a share of the common classes too
    assert (sc.counts.sum(axis=1) >= 8).all()


@pytest.mark.slow
def test_parallel_seeds_match_serial(tmp_path: Path) -> None:
    args = SMALL + ["--methods", "fedavg,federage", "--seeds", "0", "1", "--overhead-tasks", "0"]
    assert main(args + ["--out", str(tmp_path / "serial")]) == 0
    assert main(args + ["--jobs", "2", "--out", str(tmp_path / "par")]) == 0
    a, b = (json.loads((tmp_path / d / "federage_compare.json").read_text()) for d in ("serial", "par"))
    for ra, rb in zip(a["runs"], b["runs"]):  # everything but the wall-clock timings
        assert [(r["method"], r["client_acc"], r["server_beta"]) for r in ra] == \
            [(r["method"], r["client_acc"], r["server_beta"]) for r in rb]
    assert a["summary"][0]["mean_client_acc_std"] > 0


def test_paired_delta_table() -> None:
    from felix.experiments.federage import paired_delta_table

    def res(name: str, acc: float) -> dict:
        return {"method": name, "mean_client_acc": acc, "bottom10_acc": acc, "rare_client_acc": acc,
                "tail_class_acc": acc, "global_acc": acc}

    runs = [[res("fedavg", 0.7), res("x", 0.75)], [res("fedavg", 0.8), res("x", 0.79)], [res("fedavg", 0.6), res("x", 0.62)]]
    table = paired_delta_table(runs)
    # differences +0.05, -0.01, +0.02: mean +0.020, sample std 0.030, ahead on 2 of 3 seeds
    assert "| x | +0.020 ± 0.030 (2/3) |" in table and "| fedavg |" not in table
    assert paired_delta_table(runs, reference="nope") == ""
