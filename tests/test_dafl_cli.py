"""``felix plan-augmentation`` / ``python -m felix.cli.dafl``."""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from felix.cli import dafl as dafl_cli
from felix.strategies.dataplans.dafl import DaflParams, plan_dafl, plan_local_balancing

SRC = Path(dafl_cli.__file__).resolve().parents[1]
JSON_KEYS = {"I_before", "J_before", "I_after", "J_after", "added", "added_per_client", "plan_seconds"}


def _write(tmp_path: Path, text: str, name: str = "counts.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = dafl_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "client,a,b\nc1,2,1\nc2,1,1\n")
    code, out, err = _main(capsys, str(path), "--json")
    assert code == 0 and err == ""
    report = json.loads(out)  # exactly one JSON object on stdout
    assert JSON_KEYS <= set(report)
    # Hand trace in test_dafl_planner: [[2, 1], [1, 1]] -> one sample of class b on client c2.
    assert report["A"] == [[0, 0], [0, 1]]
    assert report["added"] == 1 and report["added_per_client"] == [0, 1]
    assert report["J_before"] == pytest.approx(0.02)
    assert report["I_after"] == pytest.approx(1 / 18)
    assert report["method"] == "dafl"
    assert report["clients"] == ["c1", "c2"] and report["classes"] == ["a", "b"]


def test_options_reach_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "a,b,c\n9,2,4\n1,5,1\n3,3,1\n")
    counts = [[9, 2, 4], [1, 5, 1], [3, 3, 1]]
    code, out, _ = _main(
        capsys,
        str(path),
        "--json",
        "--lambda1",
        "2",
        "--lambda2",
        "1000",
        "--tau",
        "0.01",
        "--epsilon",
        "0.01",
        "--step",
        "2",
    )
    assert code == 0
    expected = plan_dafl(counts, DaflParams(lambda1=2, lambda2=1000, tau=0.01, epsilon=0.01, step=2))
    assert json.loads(out)["A"] == expected.A.tolist()
    code, out, _ = _main(capsys, str(path), "--json", "--method", "lb", "--tau", "0")
    report = json.loads(out)
    assert report["method"] == "lb"
    assert report["A"] == plan_local_balancing(counts, 0.0).A.tolist()
    assert report["clients"] is None


def test_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "client_id,a,b\nalpha,2,1\nbeta,1,1\n")
    code, out, _ = _main(capsys, str(path))
    assert code == 0
    assert "before" in out and "after" in out
    assert "0.020000" in out  # J before
    assert "samples added: 1 in all" in out
    assert "client  beta: 1" in out
    assert "planning time:" in out


def test_out_csv_keeps_header_and_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, ",cat,dog\nnode-1,2,1\nnode-2,1,1\n")
    out_path = tmp_path / "plan.csv"
    code, _, _ = _main(capsys, str(path), "--out", str(out_path))
    assert code == 0
    rows = list(csv.reader(out_path.open(newline="")))
    assert rows == [["", "cat", "dog"], ["node-1", "0", "0"], ["node-2", "0", "1"]]
    # Without ids the plan has only the class header.
    plain = _write(tmp_path, "cat,dog\n2,1\n1,1\n", "plain.csv")
    code, _, _ = _main(capsys, str(plain), "--out", str(out_path))
    assert list(csv.reader(out_path.open(newline=""))) == [["cat", "dog"], ["0", "0"], ["0", "1"]]


def test_ids_only_from_a_declared_header_or_the_option(tmp_path: Path) -> None:
    table = dafl_cli.read_counts(_write(tmp_path, "\ufeffclient,a\n7,1\n8,2\n"))  # BOM, integer ids
    assert table.clients == ("7", "8") and table.counts.tolist() == [[1], [2]]
    table = dafl_cli.read_counts(_write(tmp_path, "a,b\n1,2\n\n3,4\n"))  # blank line skipped
    assert table.clients is None and table.counts.tolist() == [[1, 2], [3, 4]]
    # Any column, by name; the plan keeps it where it was.
    path = _write(tmp_path, "a,name,b\n1,x,2\n3,y,4\n")
    table = dafl_cli.read_counts(path, id_column="name")
    assert table.clients == ("x", "y") and table.classes == ("a", "b")
    assert table.counts.tolist() == [[1, 2], [3, 4]]
    # A class that happens to be called "id": --no-ids reads every column as a class.
    table = dafl_cli.read_counts(_write(tmp_path, "id,b\n1,2\n3,4\n"), no_ids=True)
    assert table.clients is None and table.classes == ("id", "b")


def test_id_column_keeps_its_place_in_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "cat,who,dog\n2,n1,1\n1,n2,1\n")
    out_path = tmp_path / "plan.csv"
    code, _, err = _main(capsys, str(path), "--id-column", "who", "--out", str(out_path))
    assert code == 0, err
    assert list(csv.reader(out_path.open(newline=""))) == [
        ["cat", "who", "dog"],
        ["0", "n1", "0"],
        ["0", "n2", "1"],
    ]


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        # Numbers that are not integers are never taken for client ids: the column is a class.
        ("a,b\n1e8,2\n3,4\n", (), "row 2, column 1 (a): '1e8' is not an integer count"),
        ("a,b\n1.0,2\n3,4\n", (), "row 2, column 1 (a): '1.0' is not an integer count"),
        ("a,b\n2.5,2\n3,4\n", (), "row 2, column 1 (a): '2.5' is not an integer count"),
        ("name,a,b\nx,1,2\ny,3,4\n", (), "'x' is not an integer count (a first column of client ids"),
        ("a,b\n\uff11\uff12,2\n3,4\n", (), "has digits outside ASCII 0-9"),
        ("client,a\n\u0661,1\n2,2\n", (), ""),  # an id may be any text
        ("client,a\nx,1\ny,2\nx,3\n", (), "rows 2 and 4 have the same client id 'x'"),
        ("client,a\nx,1\n,2\n", (), "row 3 has an empty client id"),
        ("a,b\n1,2\n", ("--id-column", "c"), "no column(s) named 'c' (--id-column)"),
        ("a,a\n1,2\n", ("--id-column", "a"), "2 column(s) named 'a'"),
    ],
)
def test_ids_and_digits_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, argv: tuple[str, ...], message: str
) -> None:
    code, out, err = _main(capsys, str(_write(tmp_path, text)), *argv)
    if not message:
        assert code == 0, err
        return
    assert code == 2 and out == ""
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_id_options_exclude_each_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        dafl_cli.main([str(_write(tmp_path, "a\n1\n")), "--id-column", "a", "--no-ids"])
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("a,b\n", "no client rows"),
        ("client\nc1\n", "no class columns"),
        ("a,b\n1,2\n3\n", "row 3 has 1 cells, the header has 2"),
        ("a,b\n1,2\n3,x\n", "row 3, column 2 (b): 'x' is not an integer"),
        ("a,b\n1,2.5\n3,4\n", "row 2, column 2 (b): '2.5' is not an integer"),
        ("a,b\n1,-2\n3,4\n", "row 2, column 2 (b): negative count -2"),
        ("client,a,b\nc1,0,0\nc2,3,4\n", "row 2 (client 'c1') has no samples"),
        ("a,b\n0,2\n0,4\n", "column 1 (a) has no samples on any client"),
        (
            "a,b\n1,9223372036854775808\n3,4\n",
            "row 2, column 2 (b): count 9223372036854775808 is above the maximum",
        ),
        (
            "a,b\n1,9223372036854775807\n3,4\n",
            "row 2, column 2 (b): count 9223372036854775807 is above the maximum",
        ),
        ("a,b\n1000000000000,2\n3,4\n", "row 2, column 1 (a): count 1000000000000 is above the maximum"),
        ("a,b\n100000000,1\n1,1\n", "needs at least 88,103,302 greedy steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = _write(tmp_path, text)
    code, out, err = _main(capsys, str(path))
    assert code == 2 and out == ""
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_file_and_bad_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, str(tmp_path / "nope.csv"))
    assert code == 2 and "cannot read" in err and "nope.csv" in err
    path = _write(tmp_path, "a,b\n2,1\n1,1\n")
    code, _, err = _main(capsys, str(path), "--tau", "-1")
    assert code == 2 and "tau" in err
    code, _, err = _main(capsys, str(path), "--out", str(tmp_path / "missing-dir" / "plan.csv"))
    assert code == 2 and "plan.csv" in err


def test_add_parser_mounts_on_a_parent_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parent = argparse.ArgumentParser(prog="felix")
    sub = parent.add_subparsers(dest="command", required=True)
    dafl_cli.add_parser(sub)
    path = _write(tmp_path, "a,b\n2,1\n1,1\n")
    args = parent.parse_args(["plan-augmentation", str(path), "--json", "--method", "lb"])
    assert args.func is dafl_cli.run
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "lb"


def test_runs_as_a_module(tmp_path: Path) -> None:
    path = _write(tmp_path, "a,b\n2,1\n1,1\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "felix.cli.dafl", str(path), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert JSON_KEYS <= set(json.loads(done.stdout))
    bad = subprocess.run(
        [sys.executable, "-m", "felix.cli.dafl", str(tmp_path / "nope.csv")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_rule_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # D3 at lambda2 = 100: the float rule (default) reproduces the paper's 39,060, the exact rule 39,018.
    from felix.strategies.dataplans.dafl_tables import partition

    rows = "\n".join(",".join(map(str, row)) for row in partition("D3").tolist())
    path = _write(tmp_path, "c1,c2,c3,c4,c5,c6,c7,c8\n" + rows + "\n")
    code, out, _ = _main(capsys, str(path), "--json")
    assert code == 0 and json.loads(out)["added"] == 39060
    code, out, _ = _main(capsys, str(path), "--json", "--rule", "exact")
    assert code == 0 and json.loads(out)["added"] == 39018
    code, _, err = _main(capsys, str(path), "--max-steps", "100")
    assert code == 2 and "stopped after 100 greedy steps" in err


def test_felix_plan_augmentation_does_not_import_torch(tmp_path: Path) -> None:
    path = _write(tmp_path, "a,b\n2,1\n1,1\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    probe = (
        "import sys; from felix.cli import main; code = main(['plan-augmentation', sys.argv[1], '--json']); "
        "heavy = [m for m in ('torch', 'sklearn') if m in sys.modules]; "
        "print('heavy', heavy, file=sys.stderr); sys.exit(code or (3 if heavy else 0))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(path)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["added"] == 1
    help_probe = (
        "import sys, contextlib, io\nfrom felix.cli import main\nwith contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
        "assert 'plan-augmentation' in out.getvalue() and 'dafl-experiment' in out.getvalue()\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", help_probe], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr


def test_only_provably_tiny_tables_plan_interpreted(tmp_path: Path) -> None:
    """The CLI plans interpreted (NUMBA_DISABLE_JIT in its own process) only when an upper bound on
    the work proves it cheaper than loading the kernel; Table II's cases (whose Phase 1 estimate
    is 0 for D3 while the plan takes 39,060 steps) run compiled. Either way the plan is the same."""
    from felix.strategies.dataplans.dafl import provably_tiny, step_upper_bound
    from felix.strategies.dataplans.dafl_tables import DATASET_NAMES, partition

    tiny = np.array([[3, 1, 2], [1, 2, 2]], dtype=np.int64)
    assert provably_tiny(tiny) and provably_tiny(tiny, method="lb")
    for name in DATASET_NAMES:
        for lambda2 in (1e2, 1e3, 1e4):
            params = DaflParams(lambda2=lambda2)
            counts = partition(name)
            assert not provably_tiny(counts, params)
            assert step_upper_bound(counts, params) * params.step >= plan_dafl(counts, params).added
    rng = np.random.default_rng(3)
    for _ in range(5):
        counts = np.stack([rng.multinomial(30, rng.dirichlet(np.full(4, 0.5))) + 1 for _ in range(5)])
        for params in (
            DaflParams(),
            DaflParams(lambda2=1.0, step=3),
            DaflParams(lambda1=0.0),
            DaflParams(tau=0.0),
        ):
            assert step_upper_bound(counts, params) * params.step >= plan_dafl(counts, params).added
    path = tmp_path / "counts.csv"
    path.write_text("client,a,b,c\nx,3,1,2\ny,1,2,2\n")
    out = subprocess.run(
        [sys.executable, "-m", "felix", "plan-augmentation", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert np.array_equal(np.array(json.loads(out.stdout)["A"]), plan_dafl(tiny, DaflParams()).A)


def test_time_budget_refuses_with_a_step_and_progress_is_reported() -> None:
    """A plan projected past the budget stops early, naming a step; progress arrives meanwhile."""
    from felix.strategies.dataplans.dafl import PlanProgress, PlanTooLargeError

    rng = np.random.default_rng(0)
    counts = np.stack([rng.multinomial(400, rng.dirichlet(np.full(8, 0.2))) for _ in range(400)])
    counts[:, 0] += 200  # class 0 common everywhere: a long Phase 1
    seen: list[PlanProgress] = []
    with pytest.raises(PlanTooLargeError, match=r"use a step of at least \d+ samples, or a larger budget"):
        plan_dafl(counts, DaflParams(), time_budget_s=0.05, progress=seen.append)
    assert seen and all(p.phase == 1 and p.phase1 > p.steps for p in seen)
    assert [p.steps for p in seen] == sorted(p.steps for p in seen)
    plan = plan_dafl(counts[:20], DaflParams(step=5), progress=seen.append)  # no budget: runs to the end
    assert plan.J_after <= 1e-3


def test_progress_line(capsys: pytest.CaptureFixture[str]) -> None:
    from felix.strategies.dataplans.dafl import PlanProgress

    progress = dafl_cli._Progress(sys.stderr)
    progress(PlanProgress(10, 1, 100, 0.5))  # too early: nothing
    progress(PlanProgress(50, 1, 100, dafl_cli.PROGRESS_AFTER_S + 0.1))
    progress(PlanProgress(60, 1, 100, dafl_cli.PROGRESS_AFTER_S + 0.2))  # too soon after the last
    progress(PlanProgress(150, 2, 100, dafl_cli.PROGRESS_AFTER_S + dafl_cli.PROGRESS_EVERY_S + 1))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "felix plan-augmentation: planning: Phase 1, 50 of 100 steps, 2 s",
        "felix plan-augmentation: planning: Phase 2, 150 steps (Phase 1 had 100), 8 s",
    ]
