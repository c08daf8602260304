"""How many clients one ``felix serve`` holds on this machine, over one Mosquitto broker or several.

For each client count, two runs on a local broker (server in this process, clients in
``felix emulate`` worker processes with ``--no-train``, so the clients cost only their protocol):

- tiers: every client replays a slotted trace that redraws half of the clients every ``--slot`` s
  (TierTrack STATE messages), with one training task in flight. Reported: offered and handled
  tier messages per second, and their delivery delay (client send -> server loop).
- round trips: always available, every client holds a task (concurrency = clients), and answers
  10 ms after receiving it with a zero update of the model's size (MLP on digits, 4,810
  parameters, ~19 KB per message each way). Reported: task round trips per second (dispatch,
  result, aggregation every 10) and the delivery delay of results; then the same with
  ``--checkpoint`` (a checkpoint after every aggregation, acknowledgements after it).

Also reported: the orchestrator's time per tier event (``Orchestrator.handle``, which includes
the selection it triggers), and where the server process spends its CPU: the share of each
thread (the loop thread that owns the orchestrator, paho's network thread) over the window.

Everything (broker, server, clients) shares this machine's cores, so the figures are for the
whole stack on one box. Run:
``python benchmarks/mqtt_capacity.py [--clients 50 100 200 400 800] [--horizon 120]``.

Beyond one broker: ``--brokers N`` shards the clients over N Mosquitto processes
(``felix.deploy.shards``; each with its own clients' logins and ACL) and uses the light load
generator (``benchmarks/mqtt_loadgen.py``), one process per 25,000 clients or fewer (``--loadgens``), each
in a network namespace of its own (``benchmarks/loadgen_netns.py``: its own address, made and
removed here; needs root, ``--no-netns`` runs them on 127.0.0.1), because one source address holds
only ~28,000 connections to a broker port. The open-file limit is checked first
(:func:`check_open_files`). ``--json`` runs the tier phase and prints one JSON line: ``registered``,
``offered_per_s``, ``handled_per_s``, ``delay_p50_ms``, ``delay_p95_ms``, ``server_rss_mb``,
``idle_share`` (the machine's idle share of all cores over the window), then the details (CPU by
process and server thread, orchestrator time per message, open files) and the provenance.
``--decode-worker`` and ``--link-process`` run the server as ``felix serve`` with those flags does
(their processes' CPU is reported beside the server's)::

    python benchmarks/mqtt_capacity.py --clients 100000 --brokers 4 --rate 10000 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from felix.core.commands import DispatchEval, DispatchTrain
from felix.core.events import TierChanged
from felix.engine.setup import resolve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker, ShardedBrokers, find_mosquitto
from loadgen_netns import BROKER_ADDRESS, LoadgenNamespaces
from mqtt_loadgen import client_infos, save_infos

from felix.deploy.client import MAX_CLIENTS_PER_PROCESS
from felix.deploy.link import BrokerOptions
from felix.deploy.link_process import LinkProcess
from felix.deploy.server import ServeOptions, Server
from felix.deploy.shards import shards_of
from felix.deploy.topics import SERVER_USER

# PBKDF2 iterations of the benchmark's throwaway logins (a deployment's have 1,000): at 1,000, hashing
# 100,000 of them takes ~5 min on a busy 2-core machine, and the brokers spend as much again
# checking them at connection time, which is start-up, not the message rates measured here.
LOGIN_HASH_ITERATIONS = 10


def _config(
    path: Path,
    n: int,
    phase: str,
    slot_s: float,
    horizon_s: float,
    preset: str = "custom",
    light: bool = False,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """The run's config. Up to 1,000 clients: the MLP on digits (4,810 parameters). Above, digits
    (1,437 training samples) would leave most clients without data, so Fashion-MNIST with a
    6-unit MLP (4,780 parameters: the same message sizes). ``light``: the tiers come from the load
    generator, not from a trace the clients replay."""
    big = n > 1000
    doc: dict[str, Any] = {
        "name": f"capacity-{phase}",
        "strategy": "custom",
        "seed": 0,
        "model": "mlp",
        "model_params": {"hidden": 6} if big else {},
        "dataset": {"name": "fashion_mnist" if big else "digits"},
        "partition": {"kind": "iid", "num_clients": n},
        "runtime": {"kind": "constant", "constant_s": 0.01},
        "selector": {"name": "random"},
        "eval_selector": {"name": "none"},
        "aggregator": {"name": "fedbuff"},
        "run": {"target_accuracy": 1.0, "eval_every": 0, "max_time_s": 1e6},
    }
    if phase == "tiers":
        doc["trace"] = (
            {"kind": "always"}
            if light
            else {
                "kind": "slotted",
                "unavailable_fraction": 0.5,
                "slot_s": slot_s,
                "horizon_s": horizon_s,
            }
        )
        doc["orchestrator"] = {"mode": "async", "agg_goal": 10, "concurrency": 1, "knowledge": "tiertrack"}
        if preset != "custom":  # the preset's strategy axes (felix: Oort + TierSelect, concurrency 30)
            doc["strategy"] = preset
            for key in ("selector", "eval_selector", "aggregator", "orchestrator"):
                del doc[key]
    else:
        doc["trace"] = {"kind": "always"}
        doc["orchestrator"] = {
            "mode": "async",
            "agg_goal": 10,
            "concurrency": concurrency or n,
            "knowledge": "tiertrack",
        }
    path.write_text(yaml.safe_dump(doc))
    return doc


def _offered_tier_rate(n: int, slot_s: float) -> float:
    """Expected tier changes per second: per slot, each client is down with p = 0.5, independently."""
    return n * 2 * 0.5 * 0.5 / slot_s


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of this process, by Python thread name (Linux /proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), "other")
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat; steal is busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def _tree_cpu(root: int) -> float:
    """CPU seconds of process ``root`` and its direct children (the broker; emulate and its workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(proc.name) == root or int(fields[1]) == root:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class _Timed:
    """Wraps ``Orchestrator.handle`` to time tier events (which trigger the selection); the events
    that dispatched a task (a train or eval selection ran) are also timed on their own."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.times: list[float] = []
        self.selecting: list[float] = []
        self.selecting_cpu: list[float] = []  # the loop thread's CPU time (a busy machine inflates wall time)

    def __call__(self, event: Any) -> Any:
        if not isinstance(event, TierChanged):
            return self.handle(event)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self.handle(event)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        self.times.append(dt)
        if any(isinstance(c, (DispatchTrain, DispatchEval)) for c in out):
            self.selecting.append(dt)
            self.selecting_cpu.append(dc)
        return out

    def clear(self) -> None:
        self.times.clear()
        self.selecting.clear()
        self.selecting_cpu.clear()


class _LoopWaits:
    """Where the loop thread's wall time goes over the window: its CPU and its wait for a core
    (``/proc/self/task/<tid>/schedstat``: time run, time runnable but not running); of the rest,
    its wait in the inbox for a batch (``Inbox.get_batch``, wrapped) and, with the decode worker,
    for the worker's verdicts (``DecodeWorker.collect``), each counted without the time run or
    runnable inside the call; and what remains: blocked elsewhere, mostly for the interpreter
    while a network thread holds it. Also the batches taken and their mean size. It costs the
    loop thread about 10 us per batch (four reads of ``schedstat``)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.inner = server.inbox.get_batch
        self.tid = 0
        self._fd = -1
        self.waited = 0.0
        self.worker_waited = 0.0
        self.batches = 0
        self.items = 0
        self._collect: Any = None
        server.inbox.get_batch = self  # type: ignore[method-assign]

    def _sched(self) -> tuple[float, float]:
        """(run s, runnable-waiting s) of the loop thread so far."""
        if self._fd < 0:  # the first call, on the loop thread itself
            self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        run_ns, wait_ns, _ = os.pread(self._fd, 128, 0).split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9

    def _blocked(self, call: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """``call``'s result, and the time it spent neither running nor runnable."""
        (r0, q0), t0 = self._sched(), time.perf_counter()
        out = call(*args, **kwargs)
        t1, (r1, q1) = time.perf_counter(), self._sched()
        return out, max(0.0, (t1 - t0) - (r1 - r0) - (q1 - q0))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decoder = self.server.decoder
        if decoder is not None and self._collect is None:  # started with the loop: wrapped once there
            self._collect = decoder.collect
            decoder.collect = self._collect_timed  # type: ignore[method-assign]
        out, blocked = self._blocked(self.inner, *args, **kwargs)
        self.waited += blocked
        self.batches += 1
        self.items += len(out)
        return out

    def _collect_timed(self) -> Any:
        out, blocked = self._blocked(self._collect)
        self.worker_waited += blocked
        return out

    def sample(self) -> tuple[float, ...]:
        """(run s, runnable-waiting s, inbox s, worker s, batches, items) of the loop thread so far."""
        run = Path(f"/proc/self/task/{self.tid}/schedstat").read_text().split()
        return int(run[0]) / 1e9, int(run[1]) / 1e9, self.waited, self.worker_waited, self.batches, self.items

    @staticmethod
    def shares(before: tuple[float, ...], after: tuple[float, ...], dt: float) -> dict[str, float]:
        run, runq, inbox, worker, batches, items = (a - b for a, b in zip(after, before, strict=True))
        return {
            "cpu_pct": round(100 * run / dt, 1),
            "runqueue_pct": round(100 * runq / dt, 1),
            "inbox_wait_pct": round(100 * inbox / dt, 1),
            "worker_wait_pct": round(100 * worker / dt, 1),
            "other_wait_pct": round(100 * max(0.0, dt - run - runq - inbox - worker) / dt, 1),
            "batches_per_s": round(batches / dt, 1),
            "mean_batch": round(items / max(1, batches), 1),
        }


class _LoadgenLines:
    """Reads the load generator's JSON lines (cumulative counters, once a second) on a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.last: dict[str, Any] = {}
        self.connected_s: float | None = None
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            doc = json.loads(line)
            if "connected_s" in doc:
                self.connected_s = float(doc["connected_s"])
            else:
                self.last = doc


class _Loadgens:
    """The light load generators (benchmarks/mqtt_loadgen.py): ``count`` processes, each with a
    contiguous share of the client ids and of the rate, each in a network namespace of its own when
    ``netns`` is given (its own source address: one address holds ~28,000 connections to a broker
    port). Their counters are summed."""

    def __init__(
        self,
        count: int,
        cfg_path: Path,
        n: int,
        brokers: str,
        credentials: Path,
        infos: Path,
        window_s: float,
        rate: float,
        answer: bool,
        netns: LoadgenNamespaces | None,
        tick_ms: float = 20.0,
        nice: int = 19,
    ) -> None:
        bounds = [(n * k) // count for k in range(count + 1)]
        self.procs: list[subprocess.Popen[str]] = []
        for k in range(count):
            cmd = [
                *(["nice", "-n", str(nice)] if nice else []),
                *(netns.prefix(k) if netns is not None else []),
                sys.executable,
                str(Path(__file__).with_name("mqtt_loadgen.py")),
                str(cfg_path),
                "--broker",
                brokers,
                "--credentials",
                str(credentials),
                "--infos",
                str(infos),
                "--run-id",
                "cap",
                "--first-id",
                str(bounds[k]),
                "--clients",
                str(bounds[k + 1] - bounds[k]),
                "--rate",
                str(rate / count),
                "--seed",
                str(k),
                "--duration",
                str(window_s + 900),
                *(["--answer"] if answer else []),
                "--tick-ms",
                str(tick_ms),
            ]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        self.lines = [_LoadgenLines(proc) for proc in self.procs]

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> int | None:
        """The exit code of the first load generator that ended, else None."""
        return next((code for proc in self.procs if (code := proc.poll()) is not None), None)

    def snapshot(self) -> list[dict[str, Any]]:
        return [dict(lines.last) for lines in self.lines]

    @property
    def connected_s(self) -> float | None:
        times = [lines.connected_s for lines in self.lines]
        return None if None in times else max(t for t in times if t is not None)

    def cpu(self) -> float:
        return sum(_tree_cpu(proc.pid) for proc in self.procs)

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _offered(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float | None:
    """STATE messages per second the load generators sent between two snapshots (summed)."""
    total = 0.0
    for b, a in zip(before, after, strict=True):
        dt = a.get("t", 0.0) - b.get("t", 0.0)
        if dt <= 0:
            return None
        total += (a["sent_state"] - b["sent_state"]) / dt
    return total


def _start_emulate(
    cfg_path: Path, n: int, processes: int, broker: MosquittoBroker, window_s: float
) -> subprocess.Popen[Any]:
    """``felix emulate --no-train`` worker processes (one broker, on 127.0.0.1)."""
    cmd = [
        sys.executable,
        "-m",
        "felix.deploy",
        "emulate",
        str(cfg_path),
        "--clients",
        str(n),
        "--processes",
        str(processes),
        "--broker",
        broker.address,
        "--run-id",
        "cap",
        "--credentials",
        str(broker.credentials_file),
        "--no-train",
        "--time-scale",
        "1",
        "--max-wall-s",
        str(window_s + 240),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


FD_MARGIN = 256  # descriptors a broker or load generator holds beside its connections
MAX_PER_LOADGEN = 25_000  # clients per load generator (per source address): under ~28,000 ports


def _per_broker(n: int, brokers: int) -> int:
    """Connections the fullest broker holds: its share of clients 0..n-1 and the server's."""
    return int(np.bincount(shards_of(np.arange(n), brokers), minlength=brokers).max()) + 1


def default_loadgens(n: int) -> int:
    """One load generator per 25,000 clients, or fewer clients each where the hard open-file limit
    is lower."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = MAX_PER_LOADGEN if hard == resource.RLIM_INFINITY else min(MAX_PER_LOADGEN, hard - FD_MARGIN)
    return -(-n // max(1, room))


def check_open_files(n: int, brokers: int, loadgens: int) -> dict[str, Any]:
    """The open-file limit every broker and load generator inherits from this process.

    A Mosquitto broker holds one descriptor per connection, a load generator one per client. The
    soft limit (often 1,024) is raised to the hard limit; a hard limit below what one process needs
    can be raised only with CAP_SYS_RESOURCE: this tries, and where it may not, stops with how many
    descriptors are missing and the fewest ``--brokers`` / ``--loadgens`` that fit under the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_broker, per_loadgen = _per_broker(n, brokers), -(-n // loadgens)
    need = max(per_broker, per_loadgen) + FD_MARGIN
    info: dict[str, Any] = {"soft_before": soft, "hard_before": hard, "needed_per_process": need}
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
        except (ValueError, OSError):
            fit_b = next(b for b in range(brokers, n + 1) if _per_broker(n, b) + FD_MARGIN <= hard)
            fit_l = -(-n // (hard - FD_MARGIN))
            raise SystemExit(
                f"open files: the hard limit ({hard:,} per process) is below the {need:,} descriptors needed "
                f"({per_broker:,} connections on the fullest of {brokers} brokers, {per_loadgen:,} per load "
                f"generator), and this process may not raise it (CAP_SYS_RESOURCE). Raise it where the "
                f"benchmark starts (ulimit -Hn as root, limits.conf, the container's nofile limit), or "
                f"spread the clients: --brokers {max(brokers, fit_b)} --loadgens {max(loadgens, fit_l)} fit "
                f"{n:,} clients under {hard:,}"
            ) from None
        info["note"] = f"hard limit {hard:,} < {need:,} needed per process: raised to {need:,}"
    else:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else need, hard))
    info["soft"], info["hard"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    return info


def _rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_phase(
    n: int,
    phase: str,
    window_s: float,
    processes: int,
    slot_s: float,
    work: Path,
    checkpoint: bool = False,
    horizon_s: float = 3600.0,
    loadgen: str = "emulate",
    rate: float = 0.0,
    preset: str = "custom",
    concurrency: int | None = None,
    register_timeout_s: float = 180.0,
    brokers: int = 1,
    loadgens: int = 1,
    netns: bool = False,
    decode_worker: bool = False,
    link_process: bool = False,
    loadgen_tick_ms: float = 20.0,
    loadgen_nice: int = 19,
) -> dict[str, Any]:
    """One phase: ``brokers`` brokers (shards), the server in this process, and the clients (the
    emulate workers on one broker, or ``loadgens`` light load generators, in namespaces of their
    own with ``netns``); the figures of a ``window_s`` window once every client registered."""
    light = loadgen == "light"
    if not light and (brokers > 1 or netns):
        raise SystemExit("several brokers and namespaces need --loadgen light")
    cfg_path = work / f"{phase}-{n}.yaml"
    _config(cfg_path, n, phase, slot_s, horizon_s, preset, light, concurrency)
    cfg = resolve_config(str(cfg_path), None, {})
    tag = f"{phase}-{n}{'-ck' if checkpoint else ''}"
    open_files = check_open_files(n, brokers, loadgens)
    infos = work / f"infos-{n}.npz"
    if light and not infos.exists():
        save_infos(str(infos), *client_infos(str(cfg_path), n))
    with contextlib.ExitStack() as stack:
        spaces = stack.enter_context(LoadgenNamespaces(loadgens)) if netns else None
        host = BROKER_ADDRESS if netns else "127.0.0.1"
        shards = stack.enter_context(
            ShardedBrokers(n, brokers, work / f"broker-{tag}", host=host, iterations=LOGIN_HASH_ITERATIONS)
        )
        users = yaml.safe_load(shards.credentials_file.read_text())
        addresses = BrokerOptions.parse_addresses(shards.address)
        opts = ServeOptions(
            BrokerOptions(
                *addresses[0],
                SERVER_USER,
                users[SERVER_USER],
                shards=tuple(addresses) if brokers > 1 else (),
            ),
            run_id="cap",
            status_every_s=1e9,
            decode_worker=decode_worker,
            link_process=link_process,
            checkpoint=work / f"ck-{tag}.safetensors" if checkpoint else None,
        )
        server = Server(cfg, opts)
        timed = _Timed(server.orch.handle)
        server.orch.handle = timed  # type: ignore[method-assign]
        waits = _LoopWaits(server)
        thread = threading.Thread(target=server.run, daemon=True, name="felix-loop")
        thread.start()
        waits.tid = thread.native_id or 0
        t_start = time.monotonic()
        answer = phase != "tiers"
        clients: _Loadgens | subprocess.Popen[Any] = (
            _Loadgens(
                loadgens,
                cfg_path,
                n,
                shards.address,
                shards.credentials_file,
                infos,
                window_s,
                rate if phase == "tiers" else 0.0,
                answer,
                spaces,
                loadgen_tick_ms,
                loadgen_nice,
            )
            if light
            else _start_emulate(cfg_path, n, processes, shards.brokers[0], window_s)
        )
        gens = clients if isinstance(clients, _Loadgens) else None
        try:
            deadline = time.monotonic() + register_timeout_s
            next_note = time.monotonic() + 30
            while len(server.orch.clients) < n:
                if time.monotonic() > deadline or clients.poll() is not None:
                    raise RuntimeError(f"only {len(server.orch.clients)} of {n} clients registered")
                if time.monotonic() > next_note:  # start-up of 100,000 clients takes minutes
                    next_note += 30
                    snap = gens.snapshot() if gens is not None else []
                    print(
                        f"{time.monotonic() - t_start:.0f} s: {sum(g.get('connected', 0) for g in snap)} "
                        f"connections opened ({sum(g.get('lost', 0) for g in snap)} lost), "
                        f"{len(server.orch.clients)} registered",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(0.1)
            registered_s = time.monotonic() - t_start
            settle_s = _settle(server, 60.0 if n > 10_000 else 2.0 if light else 1.0)
            s0, t0 = server.stats, time.monotonic()
            tiers0, results0, ck0 = s0.tier_messages, s0.results, s0.checkpoints
            dups0, reconnects0, in0 = s0.duplicates, s0.reconnects, s0.messages_in
            gen0 = gens.snapshot() if gens is not None else []
            # Every message of the window, not the server's last 4,096 (0.4 s at 10,000 per second).
            room = int(2 * window_s * max(rate, n / slot_s, 1.0)) + 4096
            server.latency = deque(maxlen=room)
            server.inbox_delay = deque(maxlen=room)
            timed.clear()
            cpu0 = _thread_cpu(os.getpid())
            broker_pids = [b._proc.pid if b._proc is not None else -1 for b in shards.brokers]
            others0 = (sum(_tree_cpu(pid) for pid in broker_pids), _clients_cpu(clients))
            helpers0 = _helpers_cpu(server)
            machine0 = _machine_cpu()
            waits0 = waits.sample()
            time.sleep(window_s)
            waits1 = waits.sample()
            dt = time.monotonic() - t0
            cpu1 = _thread_cpu(os.getpid())
            others1 = (sum(_tree_cpu(pid) for pid in broker_pids), _clients_cpu(clients))
            helpers1 = _helpers_cpu(server)
            machine1 = _machine_cpu()
            s1 = server.stats
            gen1 = gens.snapshot() if gens is not None else []
            lat = np.array(server.latency) * 1000.0
            queued = np.array(server.inbox_delay) * 1000.0
            sel = np.array(timed.times) * 1000.0
            dispatching = np.array(timed.selecting) * 1000.0
            dispatching_cpu = np.array(timed.selecting_cpu) * 1000.0
            busy = sorted(((cpu1[k] - cpu0.get(k, 0.0)) / dt, k) for k in cpu1)[::-1]
            offered = _offered(gen0, gen1) if gens is not None else None
            out = {
                "registered": len(server.orch.clients),
                "registered_s": registered_s,
                "settle_s": settle_s,
                "brokers": brokers,
                "loadgens": loadgens if light else 0,
                "netns": netns,
                "connected_s": gens.connected_s if gens is not None else None,
                "offered_per_s": offered if offered is not None else _offered_tier_rate(n, slot_s),
                "lost_connections": sum(g.get("lost", 0) for g in gen1),
                "reopened_connections": sum(g.get("reopened", 0) for g in gen1),
                "tier_per_s": (s1.tier_messages - tiers0) / dt,
                "results_per_s": (s1.results - results0) / dt,
                "checkpoints_per_s": (s1.checkpoints - ck0) / dt,
                "rejected": s1.rejected,
                # Every message the loop handled in the window, the copies a broker delivered again
                # among them, and the server's reconnects to a broker (which redeliver what it held).
                "messages_in_per_s": (s1.messages_in - in0) / dt,
                "duplicates_in_window": s1.duplicates - dups0,
                "reconnects_in_window": s1.reconnects - reconnects0,
                "reconnects": s1.reconnects,
                "lat_p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
                "lat_p95_ms": float(np.percentile(lat, 95)) if lat.size else float("nan"),
                # Of that delay, the wait in the server's inbox (the loop behind), the rest before.
                "inbox_delay_p50_ms": float(np.percentile(queued, 50)) if queued.size else float("nan"),
                "inbox_delay_p95_ms": float(np.percentile(queued, 95)) if queued.size else float("nan"),
                "tier_event_p50_ms": float(np.percentile(sel, 50)) if sel.size else float("nan"),
                "tier_event_p95_ms": float(np.percentile(sel, 95)) if sel.size else float("nan"),
                "tier_event_p99_ms": float(np.percentile(sel, 99)) if sel.size else float("nan"),
                "dispatching_events": int(dispatching.size),
                "dispatching_event_p50_ms": float(np.percentile(dispatching, 50))
                if dispatching.size
                else float("nan"),
                "dispatching_event_p95_ms": float(np.percentile(dispatching, 95))
                if dispatching.size
                else float("nan"),
                "dispatching_event_cpu_p50_ms": float(np.percentile(dispatching_cpu, 50))
                if dispatching.size
                else float("nan"),
                "versions": float(server.orch.version),
                "cpu": {
                    **{k.split("/")[0]: round(100 * v, 1) for v, k in busy[:3]},
                    **{k: round(100 * (helpers1[k] - helpers0[k]) / dt, 1) for k in helpers1},
                    "broker": round(100 * (others1[0] - others0[0]) / dt, 1),
                    "clients": round(100 * (others1[1] - others0[1]) / dt, 1),
                },
            }
            # The machine is shared: what the rest of it (other users' work) took in the window, in
            # % of one core, and how much of all cores stayed idle. A run starved of CPU by other
            # work shows it here rather than as a lower capacity of the server.
            helpers = sum(helpers1.values()) - sum(helpers0.values())
            ours = sum(cpu1[k] - cpu0.get(k, 0.0) for k in cpu1) + sum(others1) - sum(others0) + helpers
            machine_busy = machine1[0] - machine0[0]
            out["machine"] = {
                "cores": os.cpu_count(),
                "idle_pct": round(100 * (1 - machine_busy / max(1e-9, machine1[1] - machine0[1])), 1),
                "other_work_pct": round(100 * max(0.0, machine_busy - ours) / dt, 1),
            }
            out["server_cpu_us_per_msg"] = (
                round(1e6 * sum(cpu1[k] - cpu0.get(k, 0.0) for k in cpu1) / (s1.tier_messages - tiers0), 1)
                if s1.tier_messages > tiers0 and phase == "tiers"
                else None
            )
            # The server's own processes: the decode worker and the link process, when they run.
            out["server_and_helpers_cpu_us_per_msg"] = (
                round(
                    1e6
                    * (sum(cpu1[k] - cpu0.get(k, 0.0) for k in cpu1) + helpers)
                    / (s1.tier_messages - tiers0),
                    1,
                )
                if s1.tier_messages > tiers0 and phase == "tiers"
                else None
            )
            out["threads"] = ", ".join(f"{k} {v:.0f}%" for k, v in out["cpu"].items())
            out["server_threads_pct"] = _server_threads(cpu0, cpu1, dt)
            out["orchestrator_us_per_msg"] = (
                round(1e6 * sum(timed.times) / (s1.tier_messages - tiers0), 1)
                if s1.tier_messages > tiers0 and phase == "tiers"
                else None
            )
            out["loop_waits"] = _LoopWaits.shares(waits0, waits1, dt)
            out["server_rss_mb"] = round(_rss_mb(), 1)
            if isinstance(server.link, LinkProcess):
                out["link_process_rss_mb"] = round(_rss_mb(server.link.proc.pid), 1)
            out["open_files"] = open_files
        finally:
            if gens is not None and sum(g.get("lost", 0) for g in gens.snapshot()):
                for k, b in enumerate(shards.brokers):  # why a broker dropped connections, if it says
                    print(f"broker {k} log:\n{b._log_tail(8)}", file=sys.stderr)
            if isinstance(clients, _Loadgens):
                clients.stop()
            else:
                clients.send_signal(signal.SIGTERM)
                try:
                    clients.wait(30)
                except subprocess.TimeoutExpired:
                    clients.kill()
            server.stop_requested.set()
            thread.join(30)
    return out


# A backlog counts as drained when the median delivery delay is the goal's 50 ms: a looser bound
# (0.5 s) started the window while the burst's last seconds still drained, its p95 the backlog's.
SETTLED_DELAY_S = 0.05


def _settle(server: Server, limit_s: float) -> float:
    """Wait for the registration burst's backlog to drain: until the last 200 messages' delivery
    delay is under ``SETTLED_DELAY_S`` at the median (at least 2 s, at most ``limit_s``). How long
    it took; a server that cannot keep up with the offered rate waits the whole limit."""
    t0 = time.monotonic()
    time.sleep(min(2.0, limit_s))
    while time.monotonic() - t0 < limit_s:
        recent = list(server.latency)[-200:]
        if len(recent) >= 200 and float(np.median(recent)) < SETTLED_DELAY_S:
            break
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def _helpers_cpu(server: Server) -> dict[str, float]:
    """CPU seconds so far of the server's helper processes (the decode worker, the link process)."""
    out: dict[str, float] = {}
    if server.decoder is not None:
        out["decode_worker"] = _tree_cpu(server.decoder._proc.pid)
    if isinstance(server.link, LinkProcess):
        out["link_process"] = _tree_cpu(server.link.proc.pid)
    return out


def _clients_cpu(clients: _Loadgens | subprocess.Popen[Any]) -> float:
    return clients.cpu() if isinstance(clients, _Loadgens) else _tree_cpu(clients.pid)


def _server_threads(cpu0: dict[str, float], cpu1: dict[str, float], dt: float) -> dict[str, float]:
    """The server process's CPU over the window by kind of thread, in % of one core: the loop
    (the orchestrator's thread), paho's network threads (one per broker shard), with
    ``--link-process`` the threads that read the link process's frames instead, the rest."""
    kinds: dict[str, float] = {}
    for key, v in cpu1.items():
        name = key.split("/")[0]
        kind = (
            "loop"
            if name == "felix-loop"
            else "network"
            if name.startswith("paho")
            else "link_readers"
            if name.startswith("felix-link")
            else "other"
        )
        kinds[kind] = kinds.get(kind, 0.0) + 100 * (v - cpu0.get(key, 0.0)) / dt
    return {k: round(v, 1) for k, v in sorted(kinds.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[50, 100, 200, 400, 800])
    p.add_argument("--window", type=float, default=10.0, help="measurement window per run, seconds")
    p.add_argument(
        "--processes", type=int, default=2, help="emulate worker processes (more above 250 clients each)"
    )
    p.add_argument("--slot", type=float, default=0.25, help="trace slot (s) of the tier phase")
    p.add_argument(
        "--horizon", type=float, default=3600.0, help="trace horizon (s) of the tier phase (repeats)"
    )
    p.add_argument("--tiers-only", action="store_true", help="only the tier phase (no round trips)")
    p.add_argument(
        "--loadgen",
        choices=("emulate", "light"),
        default="emulate",
        help="clients: felix emulate --no-train workers, or benchmarks/mqtt_loadgen.py (one asyncio process)",
    )
    p.add_argument(
        "--rate", type=float, default=5000.0, help="light: tier messages offered per second, all clients"
    )
    p.add_argument("--preset", default="custom", help="strategy of the tier phase (custom: random + fedbuff)")
    p.add_argument(
        "--concurrency", type=int, default=None, help="tasks in flight in the round trips (default: clients)"
    )
    p.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="broker shards (felix.deploy.shards; more than one needs the light load generator, the default then)",
    )
    p.add_argument(
        "--loadgens",
        type=int,
        default=None,
        help="light: load-generator processes (default: one per 25,000 clients, more if the open-file "
        "limit is lower)",
    )
    p.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="light: each load generator in a network namespace of its own (needs root; default on)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="the tier phase only, its figures printed as one JSON line (with the run's provenance)",
    )
    p.add_argument("--record", type=Path, default=None, help="also write every phase's figures to this file")
    p.add_argument(
        "--decode-worker",
        action="store_true",
        help="the server parses in a worker process (felix serve --decode-worker)",
    )
    p.add_argument(
        "--link-process",
        action="store_true",
        help="the server's broker links run in a process of their own (felix serve --link-process)",
    )
    p.add_argument(
        "--loadgen-tick-ms",
        type=float,
        default=20.0,
        help="light: each load generator sends each tick's messages together and wakes at most "
        "once per tick (mqtt_loadgen.py --tick-ms)",
    )
    p.add_argument(
        "--loadgen-nice",
        type=int,
        default=19,
        choices=range(20),
        metavar="0-19",
        help="light: the load generators' niceness (default 19): these stand-ins for devices on "
        "other machines yield the shared cores to the brokers and the server under test, and what "
        "they manage to send is the offered rate reported",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the server process's GIL switch interval, seconds (sys.setswitchinterval; Python's default 0.005)",
    )
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.brokers > 1:
        args.loadgen = "light"
    if args.json:
        args.tiers_only = True
    import torch

    torch.set_num_threads(1)
    if find_mosquitto() is None:
        print("mosquitto is not installed (apt-get install mosquitto)", file=sys.stderr)
        return 2
    light = args.loadgen == "light"
    provenance = _provenance()
    if args.json:
        return _json_line(args, provenance)
    print(
        f"{os.cpu_count()} CPUs; window {args.window:.0f} s; clients: {args.loadgen}; tier phase "
        + (f"{args.rate:.0f} msgs/s offered, preset {args.preset}" if light else f"trace slot {args.slot} s")
        + "; no training\n"
    )
    header = (
        f"{'clients':>7} {'procs':>5} | {'tier offered/s':>14} {'handled/s':>9} {'p50 ms':>7} {'p95 ms':>7} "
        f"{'event ms p50/p95':>16} | {'round trips/s':>13} {'p50 ms':>7} {'p95 ms':>7} | "
        f"{'with --checkpoint':>17} {'ckpt/s':>6} {'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    threads = []
    record: list[dict[str, Any]] = []
    common = _common(args)
    with tempfile.TemporaryDirectory(prefix="felix-capacity-") as tmp:
        for n in args.clients:
            tiers = run_phase(
                n,
                "tiers",
                args.window,
                args.processes,
                args.slot,
                Path(tmp),
                horizon_s=args.horizon,
                rate=args.rate,
                **common,
            )
            record.append({"clients": n, "phase": "tiers", **tiers})
            if args.tiers_only:
                print(
                    f"{n:>7} tiers: {tiers['registered']} registered in {tiers['registered_s']:.0f} s; offered "
                    f"{tiers['offered_per_s']:.1f}/s, handled {tiers['tier_per_s']:.1f}/s, delay p50/p95 "
                    f"{tiers['lat_p50_ms']:.1f}/{tiers['lat_p95_ms']:.1f} ms, tier event p50/p95/p99 "
                    f"{tiers['tier_event_p50_ms']:.3f}/{tiers['tier_event_p95_ms']:.3f}/"
                    f"{tiers['tier_event_p99_ms']:.3f} ms ({tiers['dispatching_events']} dispatching a task: "
                    f"p50/p95 {tiers['dispatching_event_p50_ms']:.3f}/{tiers['dispatching_event_p95_ms']:.3f} ms, "
                    f"CPU p50 {tiers['dispatching_event_cpu_p50_ms']:.3f} ms); "
                    f"CPU [{tiers['threads']}]; server {tiers['server_cpu_us_per_msg']} us CPU per tier "
                    f"message; machine idle {tiers['machine']['idle_pct']}%, other work "
                    f"{tiers['machine']['other_work_pct']}% of a core",
                    flush=True,
                )
            else:
                trips = run_phase(
                    n,
                    "trips",
                    args.window,
                    args.processes,
                    args.slot,
                    Path(tmp),
                    concurrency=args.concurrency,
                    **common,
                )
                ck = run_phase(
                    n,
                    "trips",
                    args.window,
                    args.processes,
                    args.slot,
                    Path(tmp),
                    checkpoint=True,
                    concurrency=args.concurrency,
                    **common,
                )
                record += [
                    {"clients": n, "phase": "trips", **trips},
                    {"clients": n, "phase": "trips+ck", **ck},
                ]
                procs = 1 if light else max(args.processes, -(-n // MAX_CLIENTS_PER_PROCESS))
                ratio = ck["results_per_s"] / max(1e-9, trips["results_per_s"])
                print(
                    f"{n:>7} {procs:>5} | {tiers['offered_per_s']:>14.1f} {tiers['tier_per_s']:>9.1f} "
                    f"{tiers['lat_p50_ms']:>7.1f} {tiers['lat_p95_ms']:>7.1f} "
                    f"{tiers['tier_event_p50_ms']:>7.3f}/{tiers['tier_event_p95_ms']:<8.3f} | "
                    f"{trips['results_per_s']:>13.1f} {trips['lat_p50_ms']:>7.1f} {trips['lat_p95_ms']:>7.1f} | "
                    f"{ck['results_per_s']:>17.1f} {ck['checkpoints_per_s']:>6.1f} {ratio:>5.2f}",
                    flush=True,
                )
                threads.append(
                    f"{n:>7}: tiers [{tiers['threads']}]; trips [{trips['threads']}]; "
                    f"trips+checkpoint [{ck['threads']}]"
                )
    if threads:
        print("\nCPU share of one core over the window (server loop, paho network thread, broker, clients):")
        print("\n".join(threads))
    if args.record is not None:
        args.record.write_text(json.dumps({"provenance": provenance, "runs": record}, indent=1) + "\n")
    return 0


def _common(args: argparse.Namespace) -> dict[str, Any]:
    light = args.loadgen == "light"
    return {
        "loadgen": args.loadgen,
        "preset": args.preset,
        "register_timeout_s": 900.0 if light else 180.0,
        "brokers": args.brokers,
        "loadgens": args.loadgens or default_loadgens(max(args.clients)),
        "netns": light and args.netns,
        "decode_worker": args.decode_worker,
        "link_process": args.link_process,
        "loadgen_tick_ms": args.loadgen_tick_ms,
        "loadgen_nice": args.loadgen_nice,
    }


def _json_line(args: argparse.Namespace, provenance: dict[str, Any]) -> int:
    """``--json``: the tier phase of each ``--clients``, one JSON line each (the goal's figures first)."""
    with tempfile.TemporaryDirectory(prefix="felix-capacity-") as tmp:
        for n in args.clients:
            common = {**_common(args), "loadgens": args.loadgens or default_loadgens(n)}
            t = run_phase(
                n,
                "tiers",
                args.window,
                args.processes,
                args.slot,
                Path(tmp),
                horizon_s=args.horizon,
                rate=args.rate,
                **common,
            )
            line = {
                "registered": t["registered"],
                "offered_per_s": round(t["offered_per_s"], 1),
                "handled_per_s": round(t["tier_per_s"], 1),
                "delay_p50_ms": round(t["lat_p50_ms"], 2),
                "delay_p95_ms": round(t["lat_p95_ms"], 2),
                "server_rss_mb": t["server_rss_mb"],
                "idle_share": max(0.0, round(t["machine"]["idle_pct"] / 100, 3)),
                "clients": n,
                "rate": args.rate,
                "preset": args.preset,
                "window_s": args.window,
                "switch_interval_s": sys.getswitchinterval(),
                "decode_worker": args.decode_worker,
                "link_process": args.link_process,
                "loadgen_tick_ms": args.loadgen_tick_ms,
                "loadgen_nice": args.loadgen_nice,
                **{
                    k: v
                    for k, v in t.items()
                    if k not in ("registered", "offered_per_s", "tier_per_s", "threads")
                },
                "provenance": provenance,
            }
            strict = {
                k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in line.items()
            }
            print(json.dumps(strict, allow_nan=False), flush=True)  # strict JSON: no NaN (nothing measured)
    return 0


def _provenance() -> dict[str, Any]:
    """Where the figures come from: the commit, the CPU, the machine's load before the run."""
    import torch

    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            "src",
            "benchmarks",
            "tests",
        ],  # the code
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    return {
        "commit": commit + ("+dirty" if dirty else ""),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg_before": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mosquitto": find_mosquitto(),
    }


if __name__ == "__main__":
    raise SystemExit(main())
