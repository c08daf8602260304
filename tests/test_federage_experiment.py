"""End-to-end smoke run of ``felix federage-compare`` on the bundled 8x8 digits (seconds on CPU)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from felix.experiments.federage import add_parser, main

SMALL = ["--dataset", "digits", "--model", "mlp", "--clients", "8", "--rounds", "3", "--head-per-class", "60",
         "--imbalance", "5", "--batch-size", "8", "--max-steps", "2", "--federage", "0.5:0.5", "--q", "1", "-q"]


def test_federage_compare_writes_table_json_and_plot(tmp_path: Path) -> None:
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "federage_compare.json").read_text())
    names = [r["method"] for r in doc["summary"]]
    assert names == ["fedavg", "fedprox(mu=0.01)", "scaffold", "qffl(q=1)", "fedavg-ips(oracle)",
                     "federage(a=0.5,g=0.5)"]
    for row in doc["summary"]:
        assert 0.0 <= row["worst_client_acc"] <= row["bottom10_acc"] <= row["mean_client_acc"] <= 1.0
    assert len(doc["runs"][0][0]["client_acc"]) == 8
    assert "paired_overhead" in doc["scenarios"][0]
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
