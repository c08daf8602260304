"""The Ray backend of `felix compare/sweep` (optional extra felix-fl[ray]): same summaries as the
local path, retry-once-then-report when a worker dies, and a local instance that stays on loopback.

One local Ray instance (2 CPUs) serves the whole module: starting Ray costs seconds."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import threading
import time
from typing import Self

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "felix-fl[ray]"')
psutil = pytest.importorskip("psutil", reason='psutil is not installed: pip install "felix-fl[ray]"')

from felix.config import ConfigError
from felix.distributed import ray_runtime
from felix.experiments.ray_backend import RayTaskBackend
from felix.experiments.runs import InlineBackend, RunOutput, RunSpec, run_all
from felix.experiments.sweep import sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # each module starts a Ray instance: after the default suite

sys.path.insert(0, os.path.dirname(__file__))
import test_runs
from test_runs import TINY, fake_output, tiny_spec

for _module in (sys.modules[__name__], test_runs):  # Ray's workers cannot import the test modules
    ray.cloudpickle.register_pickle_by_value(_module)


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ctx = ray_runtime.start_local(num_cpus=2)
    yield ctx
    ray.shutdown()


def crash_once(spec: RunSpec) -> RunOutput:
    """Kills the Ray worker running it on its first attempt (as a dying node would), then succeeds."""
    marker = spec.out_dir.with_suffix(".attempted")
    if spec.key == "crash" and not marker.exists():
        marker.write_text("1")
        os._exit(7)
    if spec.key == "bad":
        raise ValueError("bad run")
    return fake_output(spec)


def slow_run(spec: RunSpec) -> RunOutput:
    """A stand-in for a long simulation: marks that it started, then runs for up to two minutes."""
    spec.out_dir.with_suffix(".started").write_text("1")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return fake_output(spec)


def stubborn_run(spec: RunSpec) -> RunOutput:
    """A run that swallows the polite cancel (KeyboardInterrupt), as a run whose cancel Ray lost
    would go on: only killing its worker stops it."""
    spec.out_dir.with_suffix(".started").write_text("1")
    deadline = time.monotonic() + 120
    while True:
        try:
            if time.monotonic() >= deadline:
                return fake_output(spec)
            time.sleep(0.05)
        except KeyboardInterrupt:
            continue


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class ConnectionWatch:
    """Polls every inet socket of this process and its descendants (GCS, raylet, dashboard, workers)
    while a run goes on, recording any local or remote address that is not loopback."""

    def __init__(self) -> None:
        self.bad: list[str] = []
        self.seen = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            me = psutil.Process()
            for p in [me, *me.children(recursive=True)]:
                try:
                    conns = p.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.pids.add(p.pid)
                for c in conns:
                    self.seen += 1
                    for a in (c.laddr, c.raddr):
                        if a and not _loopback(a.ip):
                            self.bad.append(f"pid {p.pid} ({p.name()}): {c.status} {c.laddr} -> {c.raddr}")
            self._stop.wait(0.1)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_ray_sweep_matches_the_local_path_and_skips_finished_runs(local_ray, tmp_path, capsys):
    sets = {k: v for k, v in TINY.items()}
    grid = {"client.lr": [0.1]}
    connects: list[object] = []

    def audit(event: str, args: tuple) -> None:
        if event == "socket.connect":
            connects.append(args[1])

    sys.addaudithook(audit)  # the driver's own Python-level connections, too
    with ConnectionWatch() as watch:
        doc_ray = sweep(None, None, sets, ["fedbuff", "felix"], grid, [0], tmp_path / "ray", backend="ray")
    doc_local = sweep(None, None, sets, ["fedbuff", "felix"], grid, [0], tmp_path / "local", backend="local")
    assert not doc_ray["failed"] and len(doc_ray["runs"]) == 2
    for a, b in zip(doc_ray["runs"], doc_local["runs"]):
        sa, sb = dict(a["summary"]), dict(b["summary"])
        sa.pop("wall_time_s"), sb.pop("wall_time_s")
        # Provenance describes the process (its git check runs once per process, so an edit during
        # the test flips 'dirty'); what must agree is the software and the run settings.
        pa, pb = sa.pop("provenance"), sb.pop("provenance")
        assert {k: pa[k] for k in ("torch", "numpy", "torch_threads", "run")} == {
            k: pb[k] for k in ("torch", "numpy", "torch_threads", "run")
        }
        assert a["key"] == b["key"] and sa == sb
        assert (tmp_path / "ray" / a["out_dir"] / "evaluations.csv").read_text() == (
            tmp_path / "local" / b["out_dir"] / "evaluations.csv"
        ).read_text()
    err = capsys.readouterr().err
    assert "done 2/2" in err
    # Safe by default: every socket of every Ray process seen during the run was loopback.
    assert watch.seen > 0 and len(watch.pids) >= 3, "the watch saw no Ray sockets"
    assert not watch.bad, "non-loopback sockets:\n" + "\n".join(watch.bad[:20])
    hosts = [a[0] for a in connects if isinstance(a, tuple) and a]
    assert all(_loopback(h) for h in hosts if h[:1].isdigit() or ":" in h), hosts
    again = sweep(None, None, sets, ["fedbuff", "felix"], grid, [0], tmp_path / "ray", backend="ray")
    assert again["skipped"] == [r["key"] for r in doc_ray["runs"]]


def test_local_instance_is_loopback_only_without_stats_or_metadata_probes(local_ray, monkeypatch):
    node = ray._private.worker._global_node
    assert node.node_ip_address == "127.0.0.1"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    listening = []
    me = psutil.Process()
    for p in me.children(recursive=True):
        try:
            listening += [
                (p.name(), c.laddr) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
            ]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert listening and all(_loopback(a.ip) for _, a in listening), listening
    # Ray's processes run with the safe environment and a Ray home holding the bootstrap config.
    home = ray_runtime.ray_home()
    envs = {}
    for p in me.children(recursive=True):
        try:
            if "site-packages/ray/" in " ".join(p.cmdline()) or p.name().startswith("ray::"):
                envs[f"{p.pid} {p.name()}"] = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    envs = {
        k: e for k, e in envs.items() if e
    }  # agents that rewrite their process title hide their environment
    assert {"gcs_server", "raylet"} <= {k.split()[1] for k in envs}, list(envs)
    wrong = {
        k: (e.get("HOME"), e.get("RAY_USAGE_STATS_ENABLED"))
        for k, e in envs.items()
        if e.get("HOME") != str(home) or e.get("RAY_USAGE_STATS_ENABLED") != "0"
    }
    assert not wrong, wrong
    assert os.environ["HOME"] != str(home)  # the driver's own HOME is restored
    # What the usage module does with that home: reads the file and makes no metadata request.
    from ray._common.usage import usage_lib

    probes: list[object] = []

    def record(url: object, *a: object, **k: object) -> object:
        probes.append(url)
        return type("Reply", (), {"status_code": 404})()

    monkeypatch.setattr(usage_lib.requests, "get", record)
    assert (
        usage_lib.get_cluster_config_to_report(str(home / ray_runtime.BOOTSTRAP_CONFIG)).cloud_provider
        == "local"
    )
    assert probes == []
    usage_lib.get_cluster_config_to_report(str(home / "missing.yaml"))  # what Ray does without the file
    assert any("169.254.169.254" in str(u) for u in probes)
    assert not usage_lib.usage_stats_enabled()


def test_a_crashed_worker_is_retried_and_a_failing_run_reported(local_ray, tmp_path):
    specs = [tiny_spec(tmp_path, k) for k in ("crash", "bad", "fine")]
    backend = RayTaskBackend(fn=crash_once)
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        out = run_all(specs, backend, log=lines.append)
    finally:
        backend.close()  # reused session: left running for the other tests
    assert ray.is_initialized()
    assert set(out.outputs) == {"crash", "fine"} and list(out.failed) == ["bad"]
    assert "ValueError: bad run" in out.failed["bad"]
    assert (tmp_path / "crash.attempted").exists() and (tmp_path / "crash" / "summary.json").exists()
    assert sum("retrying once" in line for line in lines) == 2, lines
    assert time.monotonic() - t0 < 120


def test_a_run_the_cluster_cannot_host_fails_clearly(local_ray, tmp_path):
    gpu = tiny_spec(tmp_path, "gpu")
    gpu = RunSpec(
        gpu.key,
        gpu.config.model_copy(update={"run": gpu.config.run.model_copy(update={"device": "cuda"})}),
        gpu.out_dir,
    )
    backend = RayTaskBackend()
    try:
        with pytest.raises(ConfigError, match="needs 1 GPU"):
            run_all([gpu], backend)
    finally:
        backend.close()
    assert run_all([tiny_spec(tmp_path, "x")], InlineBackend(fake_output), log=lambda _: None).outputs


def test_compare_cli_on_ray(local_ray, tmp_path, capsys):
    from test_runs import TINY_ARGS

    from felix.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--strategies", "oort", "--backend", "ray", "--out", str(out), *TINY_ARGS]) == 0
    doc = json.loads((out / "comparison.json").read_text())
    assert set(doc["strategies"]) == {"oort"} and doc["failed"] == {} and doc["reference"] == "oort"
    assert (out / "oort" / "summary.json").exists() and "done 1/1" in capsys.readouterr().err


def interrupted_run_all(specs: list[RunSpec], fn, started: int) -> tuple[object, list[str], float]:
    """``run_all`` of ``specs`` on a Ray backend running ``fn``, with a SIGINT to the driver (what
    Ctrl-C sends; run_all catches it) once ``started`` runs have started (or after 60 s): the
    outcome, the log lines and the seconds it took."""
    backend = RayTaskBackend(fn=fn)
    lines: list[str] = []

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum(s.out_dir.with_suffix(".started").exists() for s in specs) >= started:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    t0 = time.monotonic()
    try:
        out = run_all(specs, backend, log=lines.append)
    finally:
        backend.close()
    return out, lines, time.monotonic() - t0


def test_ctrl_c_cancels_the_runs_already_sent_to_workers(local_ray, tmp_path):
    """Two runs running on the two CPUs and one queued: a SIGINT to the driver cancels all three
    (ray.cancel), at once rather than after the two minutes the running ones would take."""
    specs = [tiny_spec(tmp_path, k) for k in ("a", "b", "c")]
    out, lines, elapsed = interrupted_run_all(specs, slow_run, started=2)
    assert elapsed < 90, lines
    assert not out.outputs and not out.failed, lines
    assert sorted(line for line in lines if "cancelled" in line) == [
        f"run {k} cancelled (interrupted)" for k in ("a", "b", "c")
    ], lines
    # The queued run never started; the two that ran were stopped in their workers.
    assert sum(s.out_dir.with_suffix(".started").exists() for s in specs) == 2


def test_a_run_that_does_not_stop_when_asked_has_its_worker_killed(local_ray, tmp_path, monkeypatch):
    """The polite cancel is not enough for a run that goes on (as when Ray loses the cancel of a
    task that was just starting): ``FORCE_AFTER_S`` later its worker is killed, and the run is
    reported cancelled, not failed."""
    from felix.experiments import ray_backend

    monkeypatch.setattr(ray_backend, "FORCE_AFTER_S", 2.0)
    specs = [tiny_spec(tmp_path, k) for k in ("a", "b")]
    out, lines, elapsed = interrupted_run_all(specs, stubborn_run, started=2)
    assert elapsed < 90, lines
    assert not out.outputs and not out.failed, lines
    assert sorted(line for line in lines if "cancelled" in line) == [
        f"run {k} cancelled (interrupted)" for k in ("a", "b")
    ], lines
