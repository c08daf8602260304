"""``felix run`` never loses an earlier run: ``--set`` values give their own folder, a folder that
holds a run is never written over without ``--force``, a failed run leaves no folder behind, and a
signal that arrives while a comparison's next run is being built stops that run as it starts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from felix.cli import main
from felix.engine.interrupt import stop_on_signals

TINY = """name: tiny
strategy: fedbuff
partition: {num_clients: 12}
run: {max_aggregations: 2, stop_at_target: false}
orchestrator: {agg_goal: 2, concurrency: 4}
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    return tmp_path


def _summary(folder: Path) -> dict[str, object]:
    return json.loads((folder / "summary.json").read_text())


def test_a_second_run_and_a_set_override_keep_the_first_runs_results(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "tiny.yaml", "-q"]) == 0
    first = workdir / "runs" / "tiny-fedbuff-s0"
    before = (first / "summary.json").read_text()
    assert main(["run", "tiny.yaml", "-q", "--set", "client.lr=0.1"]) == 0
    assert main(["run", "tiny.yaml", "-q", "--set", "client.lr=0.1"]) == 0
    assert main(["run", "tiny.yaml", "-q"]) == 0
    err = capsys.readouterr().err
    folders = sorted(p.name for p in (workdir / "runs").iterdir())
    assert len(folders) == 4, folders
    with_lr = [f for f in folders if f.startswith("tiny-fedbuff-s0-") and f != "tiny-fedbuff-s0-2"]
    assert len(with_lr) == 2 and with_lr[1] == with_lr[0] + "-2", folders  # same --set: same name, numbered
    assert "tiny-fedbuff-s0-2" in folders
    assert (first / "summary.json").read_text() == before  # never written over
    assert json.loads((workdir / "runs" / with_lr[0] / "config.json").read_text())["client"]["lr"] == 0.1
    assert "holds an earlier run (kept); this one goes to runs/tiny-fedbuff-s0-2" in err


def test_an_explicit_out_that_holds_a_run_is_refused_unless_forced(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "tiny.yaml", "-q", "--out", "mine"]) == 0
    before = (workdir / "mine" / "summary.json").read_text()
    capsys.readouterr()
    assert main(["run", "tiny.yaml", "-q", "--out", "mine", "--set", "client.lr=0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out mine already holds a run's files; pass --force" in err
    assert (workdir / "mine" / "summary.json").read_text() == before
    assert main(["run", "tiny.yaml", "-q", "--out", "mine", "--set", "client.lr=0.1", "--force"]) == 0
    assert json.loads((workdir / "mine" / "config.json").read_text())["client"]["lr"] == 0.1


def test_a_failed_run_leaves_no_folder(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = ["--set", "dataset.name=fashion_mnist", "--set", "dataset.root=not-there"]
    assert main(["run", "tiny.yaml", "-q", *bad]) == 2
    assert "not-there" in capsys.readouterr().err
    assert not (workdir / "runs").exists()
    (workdir / "keep").mkdir()
    assert main(["run", "tiny.yaml", "-q", *bad, "--out", "keep/a/b"]) == 2
    assert sorted(p.name for p in workdir.iterdir()) == ["keep", "tiny.yaml"]
    assert not any((workdir / "keep").iterdir())


def test_a_signal_to_an_enclosing_block_stops_a_run_as_it_starts() -> None:
    """A comparison's Ctrl-C that lands while its next run is being built (the driver's handler,
    not yet the run's) stops that run at once instead of letting it run to its end."""
    outer: list[str] = []
    inner: list[str] = []
    with stop_on_signals(lambda: outer.append("stop")):
        os.kill(os.getpid(), signal.SIGINT)
        assert outer == ["stop"]
        with stop_on_signals(lambda: inner.append("stop")):
            assert inner == ["stop"]
    with stop_on_signals(lambda: inner.append("again")):
        assert inner == ["stop"]  # a fresh block starts unstopped
