"""A client host's model downloads: fetched by hash over HTTP off the loop thread, checked, kept.

A task that names its model by hash (``felix.deploy.wire.ModelRef``) waits while the model is
fetched; the host's loop goes on with its other clients meanwhile. Each download is bounded: the
size the task declares (itself bounded by the largest message a client accepts), ``timeout_s``
wall seconds per attempt however slowly the bytes come, ``attempts`` tries with a doubling pause,
no redirects and http(s) only. Bytes whose SHA-256 is not the one the task names are refused and
fetched again (a corrupt cache or a tampered copy); after the last attempt the task fails at its
client, which reports it to the server. The clients of one host share the downloads: one fetch
per hash at a time, and the last ``cache`` models kept (a client that already holds the hash needs
no download).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from felix.deploy import wire

log = logging.getLogger("felix.deploy.model_fetch")


@dataclass(frozen=True)
class FetchOptions:
    timeout_s: float = 10.0  # per attempt, whole
    attempts: int = 3
    backoff_s: float = 0.5  # before the second attempt; doubled after each
    cache: int = 4  # models kept per host
    workers: int = 4  # downloads at once per host

    def __post_init__(self) -> None:
        if (
            self.timeout_s <= 0
            or self.attempts < 1
            or self.backoff_s < 0
            or self.cache < 1
            or self.workers < 1
        ):
            raise ValueError("fetch timeout, attempts, cache and workers must be positive")


@dataclass(frozen=True)
class Fetched:
    """A download ended: the model's bytes (checked against its hash), or why there are none."""

    sha256: str
    body: bytes | None
    error: str = ""


class FetchError(Exception):
    """One attempt failed (``wire.MessageError`` for bytes that are not the model)."""


def fetch_model(ref: wire.ModelRef, timeout_s: float) -> bytes:
    """One attempt: GET ``ref.url`` within ``timeout_s`` in all; the bytes, checked against the hash."""
    url = urllib.parse.urlsplit(ref.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise FetchError(f"not an http(s) URL: {ref.url[:80]!r}")
    end = time.monotonic() + timeout_s
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("GET", url.path or "/", headers={"Accept": "application/octet-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise FetchError(f"HTTP {resp.status} {resp.reason}")
        length = resp.getheader("Content-Length")
        if length is not None and length.strip() != str(ref.size):
            raise FetchError(f"Content-Length {length[:20]!r}, the task names {ref.size} bytes")
        parts: list[bytes] = []
        got = 0
        while got <= ref.size:
            left = end - time.monotonic()
            if left <= 0:
                raise FetchError(f"took more than {timeout_s:g} s")
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(min(1 << 20, ref.size + 1 - got))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        body = b"".join(parts)
        wire.check_model(ref, body)  # more bytes than named fail here too
        return body
    finally:
        conn.close()


class ModelFetcher:
    """Downloads for one client host: ``request`` starts one (unless that hash is on its way),
    ``notify`` gets each :class:`Fetched` on a worker thread; ``cached`` answers at once."""

    def __init__(self, opts: FetchOptions, notify: Callable[[Fetched], None]) -> None:
        self.opts = opts
        self.notify = notify
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._pending: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="model-fetch")
        self.fetched = 0  # downloads that succeeded
        self.bytes_fetched = 0
        self.refused = 0  # attempts whose bytes were not the model (wrong hash or size)
        self.failed = 0  # downloads that failed every attempt

    def cached(self, sha256: str) -> bytes | None:
        with self._lock:
            body = self._cache.get(sha256)
            if body is not None:
                self._cache.move_to_end(sha256)
            return body

    def request(self, ref: wire.ModelRef) -> None:
        with self._lock:
            if ref.sha256 in self._pending:
                return
            self._pending.add(ref.sha256)
        self._pool.submit(self._run, ref)

    def _run(self, ref: wire.ModelRef) -> None:
        error = ""
        for attempt in range(self.opts.attempts):
            if attempt:
                time.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
            try:
                body = fetch_model(ref, self.opts.timeout_s)
            except wire.MessageError as exc:
                with self._lock:
                    self.refused += 1
                error = str(exc)
                log.warning("model %s... from %s refused: %s", ref.sha256[:12], ref.url[:80], exc)
            except (FetchError, OSError, http.client.HTTPException) as exc:
                error = f"{type(exc).__name__}: {exc}"[:200]
                log.warning("model %s... from %s: %s", ref.sha256[:12], ref.url[:80], error)
            else:
                with self._lock:
                    self._cache[ref.sha256] = body
                    while len(self._cache) > self.opts.cache:
                        self._cache.popitem(last=False)
                    self._pending.discard(ref.sha256)
                    self.fetched += 1
                    self.bytes_fetched += len(body)
                self.notify(Fetched(ref.sha256, body))
                return
        with self._lock:
            self._pending.discard(ref.sha256)
            self.failed += 1
        self.notify(
            Fetched(ref.sha256, None, f"model download failed after {self.opts.attempts} attempts: {error}")
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
