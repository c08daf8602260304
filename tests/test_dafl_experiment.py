"""The DAFL experiment: its metrics (convergence rule, minority F1), the engine's convergence stop,
and ``felix dafl-experiment`` (the shipped comparison file) end to end on the bundled digits (a
scaled Table II partition, a few rounds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from felix.cli.seeds import parse_seeds
from felix.experiments.compare import load_comparison, variant_config
from felix.experiments.dafl import add_parser, main, scale_table
from felix.experiments.shipped import COMPARISONS
from felix.metrics.classification import class_metrics, confusion_matrix, f1_per_class, minority_classes
from felix.metrics.convergence import convergence_round
from felix.strategies.dataplans.dafl_tables import partition

METHODS = ["NIC", "WCEL", "LB", "FedProx", "Focal", "DAFL"]
#: The shipped file on digits: D2 scaled by 0.02, an MLP, at most 7 rounds.
TINY = [
    "--case",
    "D2",
    "--scale",
    "0.02",
    "--set",
    "dataset.name=digits",
    "--set",
    "dataset.root=null",
    "--set",
    "model=mlp",
    "--set",
    "run.max_aggregations=7",
    "--set",
    "client.batch_size=16",
    "-q",
]


# ---------------------------------------------------------------------- convergence rule
def test_convergence_needs_five_consecutive_small_changes() -> None:
    # Changes: 0.5, 0.2, then 0.0005 x 5 -> the fifth small change is round 8 (1-based).
    losses = [2.0, 1.5, 1.3, 1.2995, 1.299, 1.2985, 1.298, 1.2975, 1.0]
    assert convergence_round(losses) == 8
    assert convergence_round(losses[:7]) is None  # only four small changes
    # A large change resets the streak; so does a NaN.
    assert convergence_round([1.0, 1.0, 1.0, 1.0, 1.1, 1.1, 1.1, 1.1, 1.1, 1.1]) == 10
    assert convergence_round([1.0, 1.0, 1.0, float("nan"), 1.0, 1.0, 1.0]) is None
    # The threshold is strict, and patience and threshold are parameters.
    assert convergence_round([1.0, 1.001, 1.002, 1.003, 1.004, 1.005], threshold=0.001) is None
    assert convergence_round([1.0, 1.5, 1.5], patience=1) == 3
    assert convergence_round([1.0, 1.05, 1.1], threshold=0.1, patience=2) == 3


def test_convergence_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="threshold"):
        convergence_round([1.0], threshold=0.0)
    with pytest.raises(ValueError, match="patience"):
        convergence_round([1.0], patience=0)


# ---------------------------------------------------------------------- minority F1
def test_minority_f1_by_hand() -> None:
    # Three classes, 4 test samples each; class 2 is the rarest in training.
    y_true = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    y_pred = [0, 0, 0, 1, 1, 1, 1, 1, 2, 0, 0, 0]
    cm = confusion_matrix(y_true, y_pred, 3)
    assert cm.tolist() == [[3, 1, 0], [0, 4, 0], [3, 0, 1]]
    # Class 0: TP 3, FP 3, FN 1 -> 6/10. Class 1: TP 4, FP 1, FN 0 -> 8/9. Class 2: TP 1, FP 0, FN 3 -> 2/5.
    assert f1_per_class(cm) == pytest.approx([0.6, 8 / 9, 0.4])
    minority = minority_classes([500, 300, 20])
    assert minority.tolist() == [2]
    m = class_metrics(cm, minority)
    assert m.minority_f1 == pytest.approx(0.4)
    assert m.accuracy == pytest.approx(8 / 12)
    assert m.macro_f1 == pytest.approx((0.6 + 8 / 9 + 0.4) / 3)
    # Ties: every class at the smallest count is a minority class, their F1 averaged.
    assert minority_classes([20, 300, 20]).tolist() == [0, 2]
    assert class_metrics(cm, [0, 2]).minority_f1 == pytest.approx(0.5)


def test_f1_of_a_class_never_seen_nor_predicted_is_zero() -> None:
    assert f1_per_class(confusion_matrix([0, 0], [0, 0], 2)).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="labels"):
        confusion_matrix([0, 3], [0, 0], 2)


# ---------------------------------------------------------------------- partitions
def test_scaling_keeps_every_pair_the_paper_has() -> None:
    d2 = partition("D2")
    small = scale_table(d2, 0.1)
    assert small.shape == (8, 8)
    assert (small > 0).tolist() == (d2 > 0).tolist()
    assert small[6, 5] == 488 and small[0, 6] == 49 and small[0, 0] == 1  # 4882, 485 and 1 scaled
    assert scale_table(d2, 1.0).tolist() == d2.tolist()
    with pytest.raises(ValueError, match="scale"):
        scale_table(d2, 0.0)


# ---------------------------------------------------------------------- the file and the engine
def test_the_file_is_the_old_experiment_setting() -> None:
    comp = load_comparison(COMPARISONS / "dafl-table4.yaml")
    assert list(comp.variants) == METHODS and comp.seeds == [0, 1, 2]
    cfgs = {m: variant_config(comp, m, {}, 0) for m in METHODS}
    nic = cfgs["NIC"]
    assert nic.partition.table == scale_table(partition("D2"), 0.1).tolist()
    assert (
        nic.orchestrator.round_policy == "sync"
        and nic.orchestrator.agg_goal == 8
        and nic.orchestrator.overcommit == 1
    )
    assert nic.dataset.num_classes == 8 and nic.client.batch_size == 64 and nic.client.epochs == 2
    assert nic.run.converge_threshold == 0.01 and nic.run.converge_patience == 5 and nic.run.per_client_eval
    assert (cfgs["LB"].data_plan, cfgs["DAFL"].data_plan, cfgs["WCEL"].client.objective) == (
        "lb",
        "dafl",
        "wce",
    )
    assert cfgs["Focal"].client.objective_params == {"gamma": 2.0}
    assert cfgs["FedProx"].client.objective_params == {"mu": 0.01}


def test_the_engine_stops_at_convergence() -> None:
    """run.converge_threshold: with a threshold no change can miss, the run converges after
    patience + 1 rounds and stops there; the summary says when."""
    from felix.config import parse_set
    from felix.sim.run import run_config

    comp = load_comparison(COMPARISONS / "dafl-table4.yaml")
    sets = parse_set(
        TINY[TINY.index("--set") + 1 :: 2][:4]
        + [
            "run.converge_threshold=100",
            "run.converge_patience=2",
            f"partition.table={scale_table(partition('D2'), 0.02).tolist()}",
        ]
    )
    res = run_config(variant_config(comp, "NIC", sets, 0))
    s = res.summary
    assert s["stop_reason"] == "converged" and s["aggregations"] == 3
    assert s["convergence"] == {"round": 3, "version": 3, "time_s": res.built.recorder.train_losses[2].time_s}
    assert len(res.built.recorder.train_losses) == 3


# ---------------------------------------------------------------------- the command
def test_experiment_writes_table_iv(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    assert main(TINY + ["--out", str(tmp_path), "--seeds", "0", "1"]) == 0
    assert torch.get_num_threads() == before
    doc = json.loads((tmp_path / "dafl_results.json").read_text())
    assert [r["method"] for r in doc["summary"]] == METHODS
    assert len(doc["runs"]) == 12
    by = {(r["method"], r["seed"]): r for r in doc["runs"]}
    for r in doc["runs"]:
        assert r["minority_classes"] == [3, 7]  # C4 and C8 tie at 8 samples at this scale
        assert 0.0 <= r["minority_f1"] <= 1.0 and 0.0 <= r["macro_f1"] <= 1.0 and 0.0 < r["accuracy"] <= 1.0
        if r["converged"]:
            assert r["aggregations"] == r["rounds"] <= 7 and r["stop_reason"] == "converged"
        else:
            assert r["rounds"] is None and r["aggregations"] == 7
    assert by[("NIC", 0)]["added"] == 0 and by[("DAFL", 0)]["added"] > 0 and by[("LB", 0)]["added"] > 0
    assert by[("DAFL", 0)]["augmentation_s"] > 0
    assert by[("DAFL", 0)]["added"] == by[("DAFL", 1)]["added"]  # the plan depends on the counts only
    table = (tmp_path / "dafl_table.md").read_text()
    for needle in (
        "| Metric | Method | D2 |",
        "| Rounds | NIC |",
        "| Minority F1 | NIC |",
        "|  | DAFL |",
        "| Macro F1 |",
        "| Added samples |",
        "training-loss change < 0.01 for 5",
    ):
        assert needle in table
    assert (tmp_path / "runs" / "DAFL" / "seed-1" / "summary.json").exists()


def test_experiment_is_deterministic(tmp_path: Path) -> None:
    args = TINY + ["--variants", "DAFL", "--set", "run.max_aggregations=3", "--seeds", "0"]
    main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "dafl_results.json").read_text())["runs"][0] for d in "ab")
    for r in (a, b):
        r.pop("wall_time_s")
    assert a == b


def test_add_parser_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="felix")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["dafl-experiment", "--case", "D3", "--scale", "0.1", "--variants", "NIC,DAFL", "--seeds", "0", "1"]
    )
    assert args.command == "dafl-experiment" and args.scale == 0.1 and args.case == "D3"
    assert (
        parse_seeds(args.seeds) == [0, 1]
        and args.file == COMPARISONS / "dafl-table4.yaml"
        and callable(args.func)
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--variants", "NIC,magic"], "'magic' is not a variant"),
        (["--case", "D9"], "unknown partition 'D9'"),
        (["--scale", "-1"], "--scale must be"),
        (["--set", "run.max_aggregations=0"], "run.max_aggregations"),
        (["--scale", "1"], "the table asks for"),  # digits has too few images for the full partition
    ],
)
def test_bad_arguments_are_one_line_errors(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(TINY + ["--out", str(tmp_path)] + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_minority_classes_of_scaled_partitions() -> None:
    # D2's rarest class is C4 (20 samples), at scale 0.1 too (8); at 0.02 C8 ties with it (8 ones each).
    for scale, expected in ((1.0, [3]), (0.1, [3]), (0.02, [3, 7])):
        assert minority_classes(scale_table(partition("D2"), scale).sum(axis=0)).tolist() == expected
    assert minority_classes(partition("D3").sum(axis=0)).tolist() == [1]
