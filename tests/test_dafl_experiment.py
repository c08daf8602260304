"""The DAFL experiment: its metrics (convergence rule, minority F1) and ``felix dafl-experiment``
end to end on the bundled digits (a scaled Table II partition, a few rounds)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from felix.experiments.dafl import add_parser, main, scale_table
from felix.metrics.classification import class_metrics, confusion_matrix, f1_per_class, minority_classes
from felix.metrics.convergence import convergence_round
from felix.strategies.dataplans.dafl_tables import partition

TINY = ["--dataset", "digits", "--model", "mlp", "--scale", "0.02", "--rounds", "7", "--batch-size", "16",
        "--threads", "1", "-q"]


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


# ---------------------------------------------------------------------- the command
def test_experiment_writes_table_iv(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    assert main(TINY + ["--out", str(tmp_path), "--seeds", "0", "1"]) == 0
    assert torch.get_num_threads() == before
    doc = json.loads((tmp_path / "dafl_results.json").read_text())
    assert [r["method"] for r in doc["summary"]] == ["nic", "wcel", "lb", "fedprox", "focal", "dafl"]
    assert len(doc["runs"]) == 12 and doc["tables"]["D2"] == scale_table(partition("D2"), 0.02).tolist()
    by = {(r["method"], r["seed"]): r for r in doc["runs"]}
    for r in doc["runs"]:
        assert r["minority_classes"] == [3, 7]  # C4 and C8 tie at 8 samples at this scale
        assert 0.0 <= r["minority_f1"] <= 1.0 and 0.0 <= r["macro_f1"] <= 1.0 and 0.0 < r["accuracy"] <= 1.0
        assert len(r["train_loss"]) == 7 and r["aggregations"] == 7
        if r["converged"]:
            assert r["metrics_version"] == r["rounds"] and r["time_s"] is not None
        else:
            assert r["rounds"] is None and r["metrics_version"] == 7
    assert by[("nic", 0)]["added"] == 0 and by[("dafl", 0)]["added"] > 0 and by[("lb", 0)]["added"] > 0
    assert by[("dafl", 0)]["augmentation_s"] > 0
    assert by[("dafl", 0)]["added"] == by[("dafl", 1)]["added"]  # the plan depends on the counts only
    table = (tmp_path / "dafl_table.md").read_text()
    for needle in ("| Metric | Method | D2 |", "| Rounds | NIC |", "| Minority F1 | NIC |", "|  | DAFL |",
                   "| Macro F1 |", "| Added samples |", "training-loss change < 0.001 for 5"):
        assert needle in table


def test_experiment_is_deterministic(tmp_path: Path) -> None:
    args = TINY + ["--methods", "dafl", "--rounds", "3"]
    main(args + ["--out", str(tmp_path / "a")])
    main(args + ["--out", str(tmp_path / "b")])
    a, b = (json.loads((tmp_path / d / "dafl_results.json").read_text())["runs"][0] for d in "ab")
    for r in (a, b):
        for key in ("wall_time_s", "augmentation_wall_s", "data_plan"):
            r.pop(key)
    assert a == b


@pytest.mark.slow  # spawns two workers that import torch: ~30 s on a quiet 2-core machine
def test_parallel_seeds_match_sequential(tmp_path: Path) -> None:
    # --jobs runs each (case, seed) in its own spawned process: same runs, same order, and provenance.
    args = TINY + ["--methods", "nic,dafl", "--rounds", "2", "--seeds", "0", "1", "--threads", "1"]
    assert main(args + ["--out", str(tmp_path / "seq")]) == 0
    assert main(args + ["--out", str(tmp_path / "par"), "--jobs", "2"]) == 0
    seq, par = (json.loads((tmp_path / d / "dafl_results.json").read_text()) for d in ("seq", "par"))
    for doc in (seq, par):
        for r in doc["runs"]:
            for key in ("wall_time_s", "augmentation_wall_s", "data_plan"):
                r.pop(key)
    assert [(r["method"], r["seed"]) for r in par["runs"]] == [("nic", 0), ("dafl", 0), ("nic", 1), ("dafl", 1)]
    assert par["runs"] == seq["runs"]
    assert par["provenance"]["torch"] == torch.__version__ and par["provenance"]["threads"] == 1


def test_add_parser_registers_the_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="felix")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dafl-experiment", "--dataset-case", "D2", "--scale", "0.1", "--rounds", "30",
                              "--methods", "nic,dafl", "--seeds", "0", "1"])
    assert args.command == "dafl-experiment" and args.scale == 0.1 and args.rounds == 30
    assert args.seeds == [0, 1] and args.root == "../shared/data/cifar10-jpeg.tar.gz" and callable(args.func)


@pytest.mark.parametrize(("extra", "needle"), [
    (["--methods", "nic,magic"], "unknown method 'magic'"),
    (["--dataset-case", "D9"], "unknown partition 'D9'"),
    (["--scale", "-1"], "--scale must be"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--scale", "1"], "the table asks for"),  # digits has too few images for the full partition
])
def test_bad_arguments_are_one_line_errors(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    assert main(TINY + ["--out", str(tmp_path)] + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_minority_classes_of_scaled_partitions() -> None:
    # D2's rarest class is C4 (20 samples), at scale 0.1 too (8); at 0.02 C8 ties with it (8 ones each).
    for scale, expected in ((1.0, [3]), (0.1, [3]), (0.02, [3, 7])):
        assert minority_classes(scale_table(partition("D2"), scale).sum(axis=0)).tolist() == expected
    assert minority_classes(partition("D3").sum(axis=0)).tolist() == [1]
