"""Model downloads by hash over HTTP (``felix serve --model-http``): tasks name the model's SHA-256
and URL, the broker carries control messages only, clients fetch and check the bytes.

The wire format's reference and its checks, the built-in server's refusals and bounds, the
client's refusal of bytes that are not the named model, and whole deployments (over Mosquitto to
the target, and over the in-memory transport with SCAFFOLD's aux arrays in the model)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from mqtt_support import (
    load_config,
    one_torch_thread,  # noqa: F401  (a fixture)
    run_in_memory,
    write_config,
)

from felix.core.refusals import Refusal
from felix.deploy import wire
from felix.deploy.client_protocol import ClientProtocol, Dropped
from felix.deploy.model_fetch import Fetched, FetchOptions, ModelFetcher, fetch_model
from felix.deploy.model_http import ModelServer
from felix.deploy.model_store import ModelHosting, ModelStore

ENV = {"run": "r1", "msg_id": "s-1", "sent_at": 1700000000.5}
W = np.linspace(-1, 1, 500, dtype=np.float32)
AUX = {"scaffold_c": np.full(500, 0.5, np.float32)}


def _served(**hosting: object) -> tuple[ModelStore, ModelServer]:
    h = ModelHosting(**hosting)  # type: ignore[arg-type]
    store = ModelStore("", h.keep)
    server = ModelServer(store, h)
    store.url_base = f"http://127.0.0.1:{server.port}"
    server.start()
    return store, server


def _task(ref: wire.ModelRef | None) -> bytes:
    return wire.encode(wire.TrainTask(**ENV, client=3, task=9, version=2, weights=W, aux=AUX, model=ref))


# ---------------------------------------------------------------------- the wire format
def test_a_task_by_hash_carries_no_arrays_and_decodes_with_the_model() -> None:
    body = wire.model_body(W, AUX)
    ref = wire.model_ref(body, "http://127.0.0.1:8080/")
    data = _task(ref)
    assert len(data) < 1000 < len(_task(None))  # the header only: the arrays stay off the broker
    pending = wire.decode(data)
    assert isinstance(pending, wire.TrainTask) and pending.model == ref and pending.weights.size == 0
    assert ref.url == f"http://127.0.0.1:8080/{ref.sha256}"
    full = wire.decode(data, model_body=body)
    assert isinstance(full, wire.TrainTask)
    np.testing.assert_array_equal(full.weights, W)
    np.testing.assert_array_equal(full.aux["scaffold_c"], AUX["scaffold_c"])


@pytest.mark.parametrize(
    "body",
    [
        lambda b: b[:-4] + b"\x00\x00\x80\x7f",  # same size, one value changed
        lambda b: b[:-4],  # short
        lambda b: b + b"\x00" * 4,  # long
    ],
)
def test_bytes_that_are_not_the_named_model_are_refused(body) -> None:  # type: ignore[no-untyped-def]
    good = wire.model_body(W, AUX)
    data = _task(wire.model_ref(good, "http://h"))
    with pytest.raises(wire.MessageError) as err:
        wire.decode(data, model_body=body(good))
    assert err.value.code is Refusal.MODEL_HASH
    got = ClientProtocol("r1", 1 << 20).complete(3, data, body(good))
    assert isinstance(got, Dropped) and got.kind is Refusal.MODEL_HASH


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ({"sha256": "AB" * 32, "size": 400, "url": "http://h/x"}, "hex"),
        ({"sha256": "ab" * 32, "size": 400, "url": "file:///etc/passwd"}, "http(s) URL"),
        ({"sha256": "ab" * 32, "size": 400, "url": "http://h/a b"}, "http(s) URL"),
        ({"sha256": "ab" * 32, "size": -1, "url": "http://h/x"}, "model.size"),
        ({"sha256": "ab" * 32, "size": 400}, "sha256, size and url"),
    ],
)
def test_a_bad_model_reference_is_refused(model: dict, fragment: str) -> None:
    import json
    import struct

    data = _task(wire.model_ref(wire.model_body(W, AUX), "http://h"))
    hlen = struct.unpack_from("<I", data, 6)[0]
    header = json.loads(data[10 : 10 + hlen])
    header["model"] = model
    raw = json.dumps(header).encode()
    with pytest.raises(wire.MessageError, match=r"model") as err:
        wire.decode(data[:6] + struct.pack("<I", len(raw)) + raw)
    assert err.value.code is Refusal.BAD_FIELD and fragment in str(err.value)


def test_a_model_larger_than_the_client_accepts_is_refused_before_any_download() -> None:
    data = _task(wire.model_ref(wire.model_body(W, AUX), "http://h"))
    with pytest.raises(wire.MessageError) as err:
        wire.decode(data, max_bytes=len(data) + 100)
    assert err.value.code is Refusal.OVERSIZED


# ---------------------------------------------------------------------- the built-in server
def _request(port: int, raw: bytes, timeout: float = 5.0, source: str | None = None) -> bytes:
    """One raw request to the model server (from ``source``, another loopback address, if given)."""
    bind = None if source is None else (source, 0)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=bind) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_the_server_serves_content_addresses_only() -> None:
    store, server = _served()
    try:
        ref = store.ref(W, AUX)
        with urllib.request.urlopen(ref.url, timeout=5) as resp:
            assert resp.read() == wire.model_body(W, AUX)
            assert "immutable" in resp.headers["Cache-Control"]
        port = server.port
        for path, status in [
            ("/", 404),
            ("/etc/passwd", 404),
            (f"/{ref.sha256}/../x", 404),
            (f"/{ref.sha256.upper()}", 404),
            (f"/{'0' * 64}", 404),  # a hash it does not hold
            (f"/{ref.sha256}?x=1", 404),
        ]:
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert err.value.code == status, path
        assert _request(port, f"POST /{ref.sha256} HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.1 405")
        assert _request(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert _request(port, b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 431")
        assert server.stats.served == 1
        assert server.stats.refused == {"path": 6, "method": 1, "request": 2}
    finally:
        server.close()


def test_a_slow_client_is_cut_off_and_connections_are_bounded() -> None:
    store, server = _served(deadline_s=0.5, io_timeout_s=0.2, max_connections=2)
    try:
        ref = store.ref(W, AUX)
        port = server.port
        # A client that sends its request a byte at a time, slower than the deadline allows.
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            closed = False
            for b in f"GET /{ref.sha256} HTTP/1.1\r\n\r\n".encode():
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
            else:
                closed = s.recv(100) == b""  # answered nothing: cut off
        assert closed and time.monotonic() - t0 < 10
        assert server.stats.refused.get("slow") == 1 and server.stats.served == 0
        # Two idle connections hold both slots: a third is refused at once, until they are cut off.
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        time.sleep(0.1)
        assert _request(port, f"GET /{ref.sha256} HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.1 503")
        time.sleep(1.0)  # past the idle ones' deadline
        assert _request(port, f"GET /{ref.sha256} HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.1 200")
        for s in idle:
            s.close()
        assert server.stats.refused.get("busy") == 1 and server.stats.refused.get("slow") == 3
    finally:
        server.close()


def test_one_address_cannot_hold_the_other_requesters_slots() -> None:
    """A requester holding its ``max_per_address`` connections open is refused one more (503) at
    once, while a download from another address is served: it cannot slow everyone else's."""
    store, server = _served(max_per_address=3, deadline_s=5.0, io_timeout_s=5.0)
    try:
        ref = store.ref(W, AUX)
        get = f"GET /{ref.sha256} HTTP/1.1\r\n\r\n".encode()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _request(server.port, get).startswith(b"HTTP/1.1 503")
        assert _request(server.port, get, source="127.0.0.2").startswith(b"HTTP/1.1 200")
        assert time.monotonic() - t0 < 2.0  # neither waited for the idle ones' deadline
        for s in idle:
            s.close()
        assert server.stats.refused.get("address") == 1 and server.stats.served == 1
        with pytest.raises(ValueError, match="per address too"):
            ModelHosting(max_per_address=0)
    finally:
        server.close()


# ---------------------------------------------------------------------- the client's downloads
def test_the_client_refuses_a_tampered_model_and_fails_the_download() -> None:
    store, server = _served()
    try:
        ref = store.ref(W, AUX)
        good = store.get(ref.sha256)
        assert good is not None and fetch_model(ref, 5.0) == good
        store._bodies[ref.sha256] = good[:-4] + b"\x00\x00\x80\x7f"  # the copy it serves is tampered with
        with pytest.raises(wire.MessageError) as err:
            fetch_model(ref, 5.0)
        assert err.value.code is Refusal.MODEL_HASH
        done: list[Fetched] = []
        fetcher = ModelFetcher(FetchOptions(attempts=2, backoff_s=0.01), done.append)
        fetcher.request(ref)
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
        fetcher.close()
        assert done and done[0].body is None and "model_hash" in done[0].error
        assert fetcher.refused == 2 and fetcher.fetched == 0 and fetcher.cached(ref.sha256) is None
    finally:
        server.close()


def test_a_download_is_bounded_in_time_against_a_server_that_stalls() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def stall() -> None:  # accepts, answers the head and a few bytes, then nothing
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 400\r\n\r\n" + b"\x00" * 10)
        held.append(conn)

    threading.Thread(target=stall, daemon=True).start()
    ref = wire.ModelRef(sha256="ab" * 32, size=400, url=f"http://127.0.0.1:{port}/{'ab' * 32}")
    t0 = time.monotonic()
    with pytest.raises(OSError):
        fetch_model(ref, 0.5)
    assert time.monotonic() - t0 < 3
    listener.close()
    for c in held:
        c.close()


# ---------------------------------------------------------------------- deployments
@pytest.mark.usefixtures("one_torch_thread")
def test_in_memory_deployment_fetches_scaffold_models_by_hash(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 4}, trace={"kind": "always"}),
        {
            "strategy": "fedbuff",
            "client": {"objective": "scaffold"},
            "orchestrator": {"agg_goal": 2, "concurrency": 3},
            "run": {"max_aggregations": 4, "target_accuracy": 1.0},
        },
    )
    server, host, summ = run_in_memory(cfg, tmp_path / "out", "dl", models=ModelHosting())
    assert summ["stop_reason"] == "max_aggregations"
    models = summ["deployment"]["models"]
    size = 2 * 4 * server.num_params  # weights and the control variate, float32
    assert models["published"] >= 5 and models["bytes_published"] >= 5 * size
    assert host.models.fetched >= 4 and host.models.bytes_fetched >= 4 * size
    down = summ["wire_bytes_by_kind"]["down"]
    assert 0 < down["train"] < 2000 * summ["transport"]["messages_out"]  # headers only


# ---------------------------------------------------------------------- options
def test_the_model_options_are_checked_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from felix.cli import main

    base = ["serve", "--username", "u", "--password", "p", "--broker", "127.0.0.1:1", "--out", str(tmp_path)]
    assert main([*base, "--model-http", "x"]) == 2
    assert main([*base, "--model-dir", str(tmp_path / "m")]) == 2
    assert main([*base, "--model-http", "0.0.0.0:8000"]) == 2
    assert main([*base, "--model-http", "0", "--model-url", "file:///srv/models"]) == 2
    err = capsys.readouterr().err
    assert "--model-http expects [HOST:]PORT" in err and "--model-dir and --model-url go together" in err
    assert "needs the URL clients reach it by" in err and "is not an http(s) URL" in err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match="outside 0-65535"):
        ModelHosting(port=70000)
