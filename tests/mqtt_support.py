"""Helpers for the tests that need a real Mosquitto broker (tests/test_mqtt_*.py).

Everything is bounded in time: threads and processes are joined or killed with timeouts, and
``wait_until`` fails with a message instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from broker import MosquittoBroker, find_mosquitto

from felix.config import Config
from felix.deploy.channels import Address, Channel
from felix.deploy.client import ClientHost, ClientOptions, credentials_from_map
from felix.deploy.link import BrokerOptions
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.topics import SERVER_USER
from felix.engine.setup import resolve_config


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """In-process servers and clients train and evaluate with one torch thread, as ``felix client``
    does by default: on a small, busy machine torch's thread pool is several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


needs_mosquitto = [
    pytest.mark.mqtt,
    pytest.mark.skipif(
        find_mosquitto() is None,
        reason="mosquitto broker not installed (/usr/sbin/mosquitto; apt-get install mosquitto)",
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]


def write_config(path: Path, **sections: Any) -> Path:
    """A small digits run: MLP, slotted churn, constant 10 s runtimes (compressed by the time scale)."""
    doc: dict[str, Any] = {
        "name": "mqtt-test",
        "strategy": "felix",
        "seed": 3,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": 24, "alpha": 0.5},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.2, "slot_s": 60.0, "horizon_s": 3600.0},
        "runtime": {"kind": "constant", "constant_s": 10.0},
        "client": {"lr": 0.1, "batch_size": 16},
        "run": {"target_accuracy": 0.7, "target_window": 3, "max_time_s": 20000.0},
    }
    for k, v in sections.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) and isinstance(doc.get(k), dict) else v
    path.write_text(yaml.safe_dump(doc))
    return path


def load_config(path: Path, sets: dict[str, Any] | None = None) -> Config:
    return resolve_config(str(path), None, sets or {})


def users(broker: MosquittoBroker) -> dict[str, str]:
    return json.loads(broker.credentials_file.read_text())


def broker_options(broker: MosquittoBroker, user: str | None = None) -> BrokerOptions:
    u = users(broker)
    name = user or SERVER_USER
    return BrokerOptions("127.0.0.1", broker.port, name, u[name], reconnect_max_s=1.0)


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Background(threading.Thread):
    """Runs ``target`` in a daemon thread and re-raises its exception on ``result``."""

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc

    def result(self, timeout: float) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.name} did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


def wait_serving(
    server: Server, timeout: float = 10.0, what: str = "the server to connect and subscribe"
) -> None:
    """Wait until the server's link is connected and the broker has confirmed its subscriptions.
    The server does not wait for the SUBACK at start-up (a resumed server's backlog may come
    first), so ``connected`` alone can hold before the broker has the subscription; a message a
    test publishes in that gap has no subscriber and is dropped."""
    wait_until(lambda: server.link.connected and server.link.ready(), timeout, what)


def start_server(
    cfg: Config,
    broker: MosquittoBroker,
    out: Path,
    time_scale: float,
    checkpoint: Path | None = None,
    **serve: Any,
) -> tuple[Server, Background]:
    """The server on ``broker`` in a thread of this process (``serve``: more ``ServeOptions``)."""
    opts = ServeOptions(
        broker_options(broker),
        run_id="t",
        out_dir=out,
        checkpoint=checkpoint,
        time_scale=time_scale,
        status_every_s=1e9,
        **serve,
    )
    server = Server(cfg, opts)
    thread = Background(server.run, "server")
    thread.start()
    return server, thread


def start_clients(
    cfg: Config, broker: MosquittoBroker, ids: list[int], time_scale: float, **opts: Any
) -> tuple[ClientHost, Background]:
    o = ClientOptions(
        broker=BrokerOptions("127.0.0.1", broker.port, reconnect_max_s=1.0),
        run_id="t",
        time_scale=time_scale,
        max_wall_s=90.0,
        **opts,
    )
    host = ClientHost(cfg, ids, o, credentials_from_map(users(broker)))
    thread = Background(host.run, "clients")
    thread.start()
    return host, thread


def run_deployed(
    cfg: Config, workdir: Path, time_scale: float, timeout: float = 60.0
) -> tuple[Server, dict[str, Any]]:
    """One whole deployed run: a broker, the server and one client per config client, until the
    server finishes; both are told to stop however it ends. Returns the server and its summary."""
    ids = list(range(cfg.partition.num_clients))
    with MosquittoBroker(len(ids), workdir=workdir / "broker") as broker:
        server, thread = start_server(cfg, broker, workdir / "out", time_scale)
        host, clients = start_clients(cfg, broker, ids, time_scale)
        try:
            summ = thread.result(timeout)
            clients.result(20)
        finally:
            server.stop_requested.set()
            host.stop_requested.set()
    return server, summ


def run_in_memory(
    cfg: Config, out: Path, run_id: str, time_scale: float = 0.05, timeout: float = 60.0, **serve: Any
) -> tuple[Server, ClientHost, dict[str, Any]]:
    """One whole deployed run over the in-memory transport: the server (``serve``: more
    ``ServeOptions``) and one host for every config client, until the server finishes; both are
    told to stop however it ends. Returns the server, the host and the summary."""
    opts = ServeOptions(
        MemoryOptions(),
        run_id=run_id,
        out_dir=out,
        time_scale=time_scale,
        status_every_s=1e9,
        transport="memory",
        **serve,
    )
    server = Server(cfg, opts)
    serving = Background(server.run, "server")
    serving.start()
    copts = ClientOptions(
        broker=MemoryOptions(), run_id=run_id, time_scale=time_scale, max_wall_s=timeout, transport="memory"
    )
    host = ClientHost(cfg, list(range(cfg.partition.num_clients)), copts, lambda cid: (None, None))
    clients = Background(host.run, "clients")
    clients.start()
    try:
        summ = serving.result(timeout)
        clients.result(20)
    finally:
        server.stop_requested.set()
        host.stop_requested.set()
    return server, host, summ


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m felix.deploy ARGS`` with its output in ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "felix.deploy", "-v", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        )


def reap(*procs: subprocess.Popen[bytes], timeout: float = 10.0) -> list[int | None]:
    """Wait for processes, killing any still running after ``timeout`` s; returns exit codes."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            codes.append(None)
    return codes


class At:
    """The addresses a transport vouches for: a client's register, state and result channels."""

    @staticmethod
    def register(cid: int) -> Address:
        return Address(Channel.REGISTER, cid)

    @staticmethod
    def state(cid: int) -> Address:
        return Address(Channel.STATE, cid)

    @staticmethod
    def result(cid: int) -> Address:
        return Address(Channel.RESULT, cid)
