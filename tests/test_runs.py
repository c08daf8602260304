"""Many runs, one implementation (felix.experiments.runs): the skip rule, retry-once-then-report, local
backends, and `felix sweep` on the local backend. The Ray backend: tests/test_ray_backend.py."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from felix.cli import main
from felix.cli.seeds import parse_seeds
from felix.config import ConfigError
from felix.distributed.ray_runtime import Resources
from felix.engine.setup import resolve_config
from felix.experiments.runs import (
    InlineBackend,
    ProcessBackend,
    RunCancelled,
    RunOutput,
    RunSpec,
    execute,
    run_all,
)
from felix.experiments.sweep import parse_grid, points

TINY = {
    "partition": {"num_clients": 12},
    "model": "mlp",
    "trace": {"kind": "always"},
    "run": {"max_aggregations": 3, "target_accuracy": 0.3, "target_window": 1, "stop_at_target": False},
    "orchestrator": {"concurrency": 4, "agg_goal": 2},
}
TINY_ARGS = [
    a
    for k, v in (
        ("partition.num_clients", 12),
        ("model", "mlp"),
        ("trace.kind", "always"),
        ("run.max_aggregations", 3),
        ("run.target_accuracy", 0.3),
        ("run.target_window", 1),
        ("run.stop_at_target", "false"),
        ("orchestrator.concurrency", 4),
        ("orchestrator.agg_goal", 2),
    )
    for a in ("--set", f"{k}={v}")
]


def tiny_spec(tmp: Path, key: str, seed: int = 0, strategy: str = "fedbuff") -> RunSpec:
    return RunSpec(key, resolve_config(None, strategy, {**TINY, "seed": seed}), tmp / key)


def fake_output(spec: RunSpec) -> RunOutput:
    """A stand-in run (no training): enough of a summary for the loop's log line and files."""
    s = {
        "strategy": spec.config.strategy,
        "seed": spec.config.seed,
        "time_to_target_s": None,
        "final_accuracy": 0.5,
        "wall_time_s": 0.0,
    }
    return RunOutput(s, [])


def die_once(spec: RunSpec) -> RunOutput:
    """Kills its worker process the first time it sees a spec (a crash the pool cannot survive)."""
    marker = spec.out_dir.with_suffix(".attempted")
    if spec.key == "dies" and not marker.exists():
        marker.write_text("1")
        os._exit(3)
    return fake_output(spec)


def test_finished_runs_are_skipped_unless_forced(tmp_path):
    calls: list[str] = []

    def counting(spec: RunSpec) -> RunOutput:
        calls.append(spec.key)
        return execute(spec)

    specs = [tiny_spec(tmp_path, "a"), tiny_spec(tmp_path, "b", seed=1)]
    first = run_all(specs, InlineBackend(counting), log=lambda _: None)
    assert calls == ["a", "b"] and first.skipped == [] and not first.failed
    assert all(
        (s.out_dir / f).exists() for s in specs for f in ("summary.json", "evaluations.csv", "config.json")
    )
    lines: list[str] = []
    again = run_all(specs, InlineBackend(counting), log=lines.append)
    assert calls == ["a", "b"] and again.skipped == ["a", "b"]
    assert "2 finished before, not rerun" in lines[0]
    # Read back, a finished run gives the same summary and curve it stored.
    for k in ("a", "b"):
        assert again.outputs[k].summary == first.outputs[k].summary
        assert again.outputs[k].rows == pytest.approx(first.outputs[k].rows)
    forced = run_all(specs, InlineBackend(counting), force=True, log=lambda _: None)
    assert calls == ["a", "b", "a", "b"] and forced.skipped == []


def test_a_finished_run_leaves_nothing_alive_in_the_process(tmp_path):
    """A run's objects sit in reference cycles; ``execute`` collects them, so that a process running
    many runs in a row (``--jobs 1``, a pool or Ray worker) does not grow by a population per run."""
    from felix.client.trainer import ClientData
    from felix.core.orchestrator import Orchestrator
    from felix.sim.simulation import Simulation

    gc.collect()
    gc.disable()  # the collector's own schedule must not do execute's work here
    try:
        execute(tiny_spec(tmp_path, "a"))
        kinds = {Orchestrator, Simulation, ClientData}
        alive = [o for o in gc.get_objects() if type(o) in kinds]  # type(): no proxy's __class__
    finally:
        gc.enable()
    assert alive == []


def test_a_folder_holding_another_config_is_refused(tmp_path):
    run_all([tiny_spec(tmp_path, "a")], InlineBackend(fake_output), log=lambda _: None)
    other = tiny_spec(tmp_path, "a", seed=7)
    with pytest.raises(ConfigError, match="different config"):
        run_all([other], InlineBackend(fake_output), log=lambda _: None)


def test_a_failed_run_is_retried_once_then_reported_and_the_others_finish(tmp_path):
    seen: list[str] = []

    def flaky(spec: RunSpec) -> RunOutput:
        seen.append(spec.key)
        if spec.key == "always" or (spec.key == "once" and seen.count("once") == 1):
            raise RuntimeError(f"boom in {spec.key}")
        return fake_output(spec)

    specs = [tiny_spec(tmp_path, k) for k in ("ok", "once", "always")]
    lines: list[str] = []
    out = run_all(specs, InlineBackend(flaky), log=lines.append)
    assert sorted(seen) == ["always", "always", "ok", "once", "once"]
    assert list(out.outputs) == ["ok", "once"]
    assert out.failed == {"always": "RuntimeError: boom in always"}
    assert (
        not (tmp_path / "always" / "summary.json").exists() and (tmp_path / "once" / "summary.json").exists()
    )
    assert lines[-1].startswith("done 3/3") or any(line.startswith("done 3/3") for line in lines)
    assert any("retrying once" in line for line in lines)


@pytest.mark.slow
def test_a_dead_worker_process_is_retried_on_a_fresh_pool(tmp_path):
    specs = [tiny_spec(tmp_path, k) for k in ("dies", "fine")]
    backend = ProcessBackend(2, die_once)
    try:
        out = run_all(specs, backend, log=lambda _: None)
    finally:
        backend.close()
    assert not out.failed and set(out.outputs) == {"dies", "fine"}
    assert (tmp_path / "dies.attempted").exists()


def test_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="share a key"):
        run_all([tiny_spec(tmp_path, "a"), tiny_spec(tmp_path, "a")], InlineBackend(fake_output))
    a, b = tiny_spec(tmp_path, "a"), tiny_spec(tmp_path, "b")
    with pytest.raises(ConfigError, match="same folder"):
        run_all([a, RunSpec("b", b.config, a.out_dir)], InlineBackend(fake_output))


def test_grid_and_seed_parsing():
    assert parse_grid(["client.lr=0.05,0.1", "orchestrator.mode=[sync, async]"]) == {
        "client.lr": [0.05, 0.1],
        "orchestrator.mode": ["sync", "async"],
    }
    assert parse_grid(["trace.series=2,3_75"]) == {"trace.series": [2, "3_75"]}  # YAML 1.2, like --set
    assert parse_seeds(["0,1,2"]) == parse_seeds(["0", "1", "2"]) == parse_seeds(["0,1", "2"]) == [0, 1, 2]
    assert parse_seeds(None) is None
    pts = points(["fedbuff", "felix"], {"client.lr": [0.05, 0.1]}, [0, 1])
    assert (
        len(pts) == 8
        and pts[0].key == "fedbuff/client.lr=0.05/seed=0"
        and pts[0].group == "fedbuff/client.lr=0.05"
    )
    for bad in (["client.lr"], ["client.lr="], ["a=1", "a=2"], ["a=[1"]):
        with pytest.raises(ConfigError):
            parse_grid(bad)
    for bad in (["a,b"], ["1,1"], ["1", "1"], [","], ["-1"]):
        with pytest.raises(ConfigError, match="--seeds expects"):
            parse_seeds(bad)


def test_resources_follow_run_device_and_threads():
    assert Resources.for_run("cpu", 1) == Resources(1.0, 0.0)
    assert Resources.for_run("cpu", 3, gpus_per_run=0.25) == Resources(3.0, 0.0)
    assert Resources.for_run("cuda", 1, gpus_per_run=0.25) == Resources(1.0, 0.25)
    assert Resources.for_run("cuda:1", None) == Resources(1.0, 1.0)
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ConfigError):
            Resources.for_run("cuda", 1, gpus_per_run=bad)


def test_sweep_cli_local(tmp_path, capsys):
    out = tmp_path / "sw"
    rc = main(
        [
            "sweep",
            "--strategies",
            "fedbuff",
            "--grid",
            "client.lr=0.05,0.2",
            "--seeds",
            "0",
            "1",
            "--out",
            str(out),
            "--jobs",
            "1",
            *TINY_ARGS,
        ]
    )
    assert rc == 0
    assert f"felix sweep: wrote {out / 'sweep.md'} and {out / 'sweep.json'}" in capsys.readouterr().err
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["key"] for r in doc["runs"]] == [
        "fedbuff/client.lr=0.05/seed=0",
        "fedbuff/client.lr=0.05/seed=1",
        "fedbuff/client.lr=0.2/seed=0",
        "fedbuff/client.lr=0.2/seed=1",
    ]
    assert [r["seed"] for r in doc["runs"]] == [0, 1, 0, 1]
    cfg = json.loads((out / doc["runs"][2]["out_dir"] / "config.json").read_text())
    assert cfg["client"]["lr"] == 0.2 and cfg["seed"] == 0
    # Different seeds, different runs; the grouped table has one row per grid point.
    s = [r["summary"] for r in doc["runs"]]
    assert s[0]["final_accuracy"] != s[1]["final_accuracy"] or s[0]["bytes_up"] != s[1]["bytes_up"]
    md = (out / "sweep.md").read_text()
    assert "| fedbuff/client.lr=0.05 | 2 |" in md and "| fedbuff/client.lr=0.2/seed=1 |" in md
    assert main(["sweep", "--grid", "client.lr=0.05,-1", "--out", str(tmp_path / "bad"), *TINY_ARGS]) == 2
    assert not (tmp_path / "bad").exists()  # every config is validated before anything runs


@pytest.mark.parametrize("command", ["compare", "sweep", "dafl-experiment", "federage-compare"])
def test_every_command_takes_seeds_space_or_comma_separated(command):
    """One ``--seeds`` convention: ``0 1 2``, ``0,1,2`` and a mix give the same seeds everywhere."""
    from felix.cli import build_parser

    for form in (["0", "1", "2"], ["0,1,2"], ["0,1", "2"]):
        args = build_parser(command).parse_args([command, "--seeds", *form])
        assert parse_seeds(args.seeds) == [0, 1, 2], (command, form)


class _FakeRay:
    """Records the Ray calls a driver makes; a task finishes only when ``ready`` names it, and then
    ends in ``error`` (a stand-in for Ray's exceptions) if one is set."""

    class exceptions:  # mirrors ``ray.exceptions``
        class RayError(Exception):
            pass

        class TaskCancelledError(RayError):
            pass

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.ready: list[object] = []
        self.error: Exception | None = None

    def cancel(self, ref: object, force: bool) -> None:
        self.calls.append(("force" if force else "cancel", ref))

    def wait(self, handles: list[object], num_returns: int, timeout: float) -> tuple[list, list]:
        self.calls.append(("wait", timeout))
        return self.ready, [h for h in handles if h not in self.ready]

    def get(self, ref: object) -> object:
        if self.error is not None:
            raise self.error
        return ref


def test_ray_interrupt_makes_no_ray_call_in_the_signal_handler_and_the_loop_cancels_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C reaches the driver's handler possibly from within ``ray.wait``'s own signal checks:
    the handler only flags, and each bounded ``wait`` of the driver's loop (re)cancels what is live,
    politely first and, ``FORCE_AFTER_S`` after the first cancel, by killing the workers (Ray can
    lose a polite cancel that reaches a task as it starts); a task that then ends in an error
    (its worker killed) is reported cancelled, not failed."""
    from felix.experiments import ray_backend
    from felix.experiments.ray_backend import WAIT_S, RayTaskBackend

    backend = RayTaskBackend.__new__(RayTaskBackend)  # no Ray instance: only the driver-side logic
    fake = _FakeRay()
    backend.ray = fake
    backend._live = {"a", "b"}
    backend._cancel = False
    backend._cancelled_at = None
    assert list(backend.wait(["a", "b"])) == [] and fake.calls == [("wait", WAIT_S)]
    fake.calls.clear()
    backend.interrupt()
    assert fake.calls == []  # nothing from the signal handler
    for _ in range(2):
        assert list(backend.wait(["a", "b"])) == []
    assert sorted(c for c in fake.calls if c[0] != "wait") == [("cancel", "a")] * 2 + [("cancel", "b")] * 2
    assert [c for c in fake.calls if c[0] == "wait"] == [("wait", WAIT_S)] * 2
    fake.calls.clear()
    monkeypatch.setattr(ray_backend, "FORCE_AFTER_S", 0.0)  # the grace has passed
    fake.ready, fake.error = ["a"], fake.exceptions.RayError("worker killed")
    (ref, out), *rest = list(backend.wait(["a", "b"]))
    assert not rest and ref == "a" and isinstance(out, RunCancelled)
    assert sorted(c for c in fake.calls if c[0] != "wait") == [("force", "a"), ("force", "b")]
    assert backend._live == {"b"}
    # Before any interrupt, an error is the run's failure, reported as such.
    backend._cancel, backend._live = False, {"b"}
    fake.ready, fake.error = ["b"], fake.exceptions.RayError("run raised")
    (_, out), *_ = list(backend.wait(["b"]))
    assert isinstance(out, fake.exceptions.RayError)
