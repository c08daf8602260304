"""Many simulated runs, one implementation: the run spec, the run function, the skip rule and the
loop that schedules them on a backend (in-process, local processes or Ray tasks).

A run function only computes: it takes a :class:`RunSpec` and returns a :class:`RunOutput` (summary,
evaluation rows, the config it ran), writing nothing. The driver stores every output under the
spec's folder, so results land on the machine that asked for them whether the run executed here,
in a worker process or on another node of a Ray cluster. A run whose ``summary.json`` exists is
not run again unless ``force`` is set; a run that fails (an exception, a dead worker or node) is
tried once more and then reported, and the others carry on.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

from felix.config import Config, ConfigError
from felix.engine.interrupt import ignore_stop_signals, stop_on_signals
from felix.metrics.recorder import EvalRow
from felix.metrics.report import write_run

MAX_ATTEMPTS = 2  # a failed run is retried once, then reported


@dataclass(frozen=True)
class RunSpec:
    """One run to do: a unique key for tables and logs, the validated config, the folder its
    outputs go to (absolute, on the driver's machine) and the driver's working directory, against
    which the config's relative paths (dataset root, trace file) resolve."""

    key: str
    config: Config
    out_dir: Path
    workdir: str = field(default_factory=os.getcwd)

    @property
    def done(self) -> bool:
        """Finished: a summary exists and the run was not interrupted (an interrupted run, or an
        unreadable summary, is run again)."""
        try:
            summary = json.loads((self.out_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(summary, dict) and summary.get("stop_reason") != "interrupted"


@dataclass(frozen=True)
class RunOutput:
    """What a run sends back: small (a summary and one row per evaluation), whatever its scale."""

    summary: dict[str, Any]
    rows: list[EvalRow]


def warm_process() -> None:
    """Import the run stack and build one optimiser (the first construction in a process imports
    ``torch._dynamo``: seconds of CPU), so that a fresh worker's first run costs what a warm
    process's does. Ray backends run it once per worker when they start."""
    import torch

    import felix.sim.run  # noqa: F401  (the imports are the point)

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def execute(spec: RunSpec) -> RunOutput:
    """The run function every backend calls: simulate ``spec.config`` with ``run.threads`` torch
    threads (the same on every backend, so float reductions, hence summaries, match) and return its
    results."""
    import torch

    from felix.sim.run import run_config

    if os.getcwd() != spec.workdir:
        if not os.path.isdir(spec.workdir):
            raise FileNotFoundError(
                f"run {spec.key}: working directory {spec.workdir} does not exist on this "
                "machine; run the sweep from a folder every node shares, or use absolute paths"
            )
        os.chdir(spec.workdir)
    threads = torch.get_num_threads()
    if spec.config.run.threads is not None:
        torch.set_num_threads(spec.config.run.threads)
    # Evaluations go to the run's folder as they happen where the driver's output folder is reachable
    # (this machine, or a shared file system); the driver rewrites the file whole when the run ends.
    # (A comparison's run folder is <out>/<variant>/seed-<n>: its grandparent is the driver's folder.)
    reachable = spec.out_dir.parent.is_dir() or spec.out_dir.parent.parent.is_dir()
    live = spec.out_dir if reachable else None
    try:
        res = run_config(spec.config, None, plots=False, interruptible=True, live_dir=live, run_name=spec.key)
    finally:
        torch.set_num_threads(threads)
        # A finished run's objects (simulation, orchestrator, the population's tensors) sit in
        # reference cycles, which Python's generational collector reaches only now and then: a
        # process running many runs one after another (--jobs 1, a pool or Ray worker) kept about
        # 200 MB per run of the felix-cpu scenarios until it ran out of memory. Collect them here.
        gc.collect()
    return RunOutput(res.summary, res.rows)


def store(spec: RunSpec, out: RunOutput) -> None:
    """Write a finished run under its folder: summary.json, evaluations.csv and config.json."""
    write_run(spec.out_dir, out.summary, out.rows, plots=False)
    (spec.out_dir / "config.json").write_text(spec.config.model_dump_json(indent=2) + "\n")


def _results_part(cfg: Config) -> Config:
    """``cfg`` without the keys that do not change a run's results (the trackers it reports to):
    a finished run is read back whatever they say (and not reported again; --force reruns it)."""
    run = cfg.run.model_copy(update={"log_to": [], "mlflow_uri": None, "mlflow_experiment": None})
    return cfg.model_copy(update={"run": run})


def load(spec: RunSpec) -> RunOutput:
    """A finished run read back from its folder; refuses a folder that holds a different config."""
    cfg_file = spec.out_dir / "config.json"
    if cfg_file.exists():
        try:
            stored = Config.model_validate_json(cfg_file.read_text())
        except ValueError as exc:
            raise ConfigError(f"{cfg_file}: unreadable config of a finished run ({exc})") from None
        if _results_part(stored) != _results_part(spec.config):
            raise ConfigError(
                f"{spec.out_dir} holds a finished run of a different config than {spec.key}; "
                "pass --force to run it again, or choose another --out"
            )
    try:
        summary = json.loads((spec.out_dir / "summary.json").read_text())
        with open(spec.out_dir / "evaluations.csv", newline="") as f:
            rows = [
                EvalRow(
                    float(r["time_s"]),
                    int(r["version"]),
                    float(r["accuracy"]),
                    float(r["loss"]),
                    int(r["bytes_total"]),
                    int(r["bytes_down"]),
                    int(r["bytes_up"]),
                    int(r.get("bytes_train") or 0),  # absent from runs written before the split
                    int(r.get("bytes_eval") or 0),
                )
                for r in csv.DictReader(f)
            ]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"{spec.out_dir}: cannot read the finished run ({exc}); pass --force to rerun it"
        ) from None
    return RunOutput(summary, rows)


class RunCancelled(Exception):
    """A run that a backend stopped because the driver was interrupted (Ctrl-C, SIGTERM): neither
    finished nor failed, so it is reported as cancelled and never retried."""


class Backend(Protocol):
    """Where runs execute. ``submit`` starts one; ``wait`` yields (handle, output or the error that
    ended it) for the runs that have finished, blocking until at least one has or, for a backend
    that must come back to the driver's loop to act on an interrupt, for a bounded time (then it
    may yield nothing)."""

    def submit(self, spec: RunSpec) -> object: ...

    def wait(self, handles: list[object]) -> Iterator[tuple[object, RunOutput | BaseException]]: ...


RunFunction = Callable[[RunSpec], RunOutput]


class InlineBackend:
    """Runs one spec at a time in this process (``--jobs 1``): no pickling, tracebacks stay local."""

    def __init__(self, fn: RunFunction = execute) -> None:
        self.fn = fn

    @dataclass(eq=False)
    class _Call:
        spec: RunSpec

    def submit(self, spec: RunSpec) -> object:
        return self._Call(spec)

    def cancel(self, handle: object) -> bool:
        return True  # a call starts only in ``wait``

    def wait(self, handles: list[object]) -> Iterator[tuple[object, RunOutput | BaseException]]:
        h = handles[0]
        assert isinstance(h, self._Call)
        try:
            yield h, self.fn(h.spec)
        except Exception as exc:  # noqa: BLE001 - any failing run is reported, the others go on
            yield h, exc


class ProcessBackend:
    """``--jobs N`` local processes (spawned, so every run starts from a fresh interpreter). A worker
    that dies breaks the pool: its runs fail (and are retried) and a new pool takes the next ones."""

    def __init__(self, jobs: int, fn: RunFunction = execute) -> None:
        self.jobs, self.fn = jobs, fn
        self.pool: ProcessPoolExecutor | None = None

    def submit(self, spec: RunSpec) -> object:
        if self.pool is not None:
            try:
                return self.pool.submit(self.fn, spec)
            except BrokenProcessPool:
                self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = ProcessPoolExecutor(
            self.jobs, mp_context=get_context("spawn"), initializer=ignore_stop_signals
        )
        return self.pool.submit(self.fn, spec)

    def cancel(self, handle: object) -> bool:
        """Drop a run that has not started (True); a running one goes on."""
        return handle.cancel()  # type: ignore[attr-defined]

    def interrupt(self) -> None:
        """Ask the runs in the workers to stop (SIGTERM: each ends ``interrupted``, see felix.engine.interrupt)."""
        for proc in list(getattr(self.pool, "_processes", None) or {}):
            try:
                os.kill(proc, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait(self, handles: list[object]) -> Iterator[tuple[object, RunOutput | BaseException]]:
        futs: list[Future[RunOutput]] = handles  # type: ignore[assignment]
        done, _ = wait(futs, return_when=FIRST_COMPLETED)
        for f in done:
            exc = f.exception()
            yield f, (exc if exc is not None else f.result())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class Outcome:
    """Every run's output by key, in spec order, the runs that failed twice, with the last error,
    and the runs a Ctrl-C or SIGTERM stopped or kept from starting."""

    outputs: dict[str, RunOutput]
    failed: dict[str, str]
    skipped: list[str]
    interrupted: list[str] = field(default_factory=list)


def run_all(
    specs: list[RunSpec], backend: Backend, force: bool = False, log: Callable[[str], None] | None = None
) -> Outcome:
    """Do every spec on ``backend``: finished runs are read back instead (unless ``force``), results are
    stored as they arrive with a live ``done N/M`` line, a failed run is retried once."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"two runs share a key: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    if len({s.out_dir for s in specs}) != len(specs):
        raise ConfigError(
            "two runs would write to the same folder; make their swept values differ in more than punctuation"
        )
    outputs: dict[str, RunOutput] = {}
    failed: dict[str, str] = {}
    skipped = [s.key for s in specs if s.done and not force]
    for s in specs:
        if s.key in skipped:
            outputs[s.key] = load(s)
    total, finished = len(specs), len(skipped)
    if skipped:
        say(f"done {finished}/{total}: {len(skipped)} finished before, not rerun (--force reruns them)")
    attempts: dict[str, int] = {}
    pending: dict[object, RunSpec] = {}
    for s in specs:
        if s.key not in outputs:
            attempts[s.key] = 1
            pending[backend.submit(s)] = s
    stopping = False  # Ctrl-C / SIGTERM, or a run came back interrupted: no new run starts
    interrupted: list[str] = []

    def interrupt() -> None:
        nonlocal stopping
        stopping = True
        forward = getattr(backend, "interrupt", None)
        if forward is not None:
            forward()

    with stop_on_signals(interrupt):
        while pending:
            if stopping:
                interrupt()  # again: a run a worker took from its queue since then stops too
                cancel = getattr(backend, "cancel", None)
                for h in [h for h in pending if cancel is not None and cancel(h)]:
                    interrupted.append(pending[h].key)
                    say(f"run {pending.pop(h).key} not started (interrupted)")
                if not pending:
                    break
            for handle, result in backend.wait(list(pending)):
                spec = pending.pop(handle)
                if isinstance(result, RunCancelled):
                    interrupted.append(spec.key)
                    say(f"run {spec.key} cancelled (interrupted)")
                    continue
                if isinstance(result, BaseException):
                    reason = _reason(result)
                    if attempts[spec.key] < MAX_ATTEMPTS and not stopping:
                        attempts[spec.key] += 1
                        say(f"run {spec.key} failed ({reason}); retrying once")
                        pending[backend.submit(spec)] = spec
                        continue
                    failed[spec.key] = reason
                    finished += 1
                    say(f"done {finished}/{total}: {spec.key} FAILED twice ({reason})")
                    continue
                store(spec, result)
                outputs[spec.key] = result
                finished += 1
                say(f"done {finished}/{total}: {spec.key} {_brief(result.summary)}")
                if result.summary.get("stop_reason") == "interrupted":
                    interrupted.append(spec.key)
                    stopping = True
    ordered = {s.key: outputs[s.key] for s in specs if s.key in outputs}
    return Outcome(ordered, failed, skipped, [s.key for s in specs if s.key in interrupted])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BrokenProcessPool):
        return "worker process died"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def _brief(s: dict[str, Any]) -> str:
    ttt = "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.0f}s"
    acc = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.4f}"
    stopped = " (interrupted)" if s.get("stop_reason") == "interrupted" else ""
    return f"time-to-target {ttt}, final acc {acc}, wall {s['wall_time_s']:.1f}s{stopped}"
