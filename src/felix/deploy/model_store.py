"""Model versions by content address: the bytes a task would carry, published once under their hash.

With model downloads over HTTP (``ServeOptions.models``), a TRAIN or EVAL task names its arrays
by SHA-256 and URL (``felix.deploy.wire.ModelRef``) instead of carrying them through the broker:
the broker carries control messages only, and a model version costs the server one encoding and
one hash however many clients fetch it. The store keeps the last ``keep`` models (a training
task's and an evaluation's differ when the strategy sends aux arrays) in memory for the built-in
server (``felix.deploy.model_http``) and, with a ``folder``, writes each as a file named by its hash
for a static file server or CDN the user points clients at (``url``); older ones are removed.
A task dispatched on an evicted model fails at its client (the download finds nothing), which the
server counts as a failed task, as any other.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from felix.deploy import wire


@dataclass(frozen=True)
class ModelHosting:
    """Where the models of ``felix serve`` are downloaded from.

    ``port``: the built-in HTTP server's port on ``host`` (0: any free one; None: no built-in
    server, ``folder`` is served by another). ``url``: the base URL clients fetch
    ``<url>/<sha256>`` from (default ``http://host:port``). ``folder``: also write each model there.
    The built-in server takes at most ``max_connections`` at once, at most ``max_per_address`` of
    them from one address (one requester cannot hold the others' slots), each for ``deadline_s``
    wall seconds at most, ``io_timeout_s`` per read or write."""

    host: str = "127.0.0.1"
    port: int | None = 0
    url: str | None = None
    folder: Path | None = None
    keep: int = 16
    max_connections: int = 64
    max_per_address: int = 16
    deadline_s: float = 30.0
    io_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.port is None and (self.folder is None or self.url is None):
            raise ValueError("model downloads without the built-in server need a folder and its URL")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"model server port {self.port} is outside 0-65535")
        if self.url is None and self.host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"model server on {self.host!r} (every address) needs the URL clients reach it by"
            )
        if self.url is not None and not wire.is_model_url(self.url):
            raise ValueError(f"model URL {self.url!r} is not an http(s) URL")
        if (
            self.keep < 2
            or self.max_connections < 1
            or self.max_per_address < 1
            or self.deadline_s <= 0
            or self.io_timeout_s <= 0
        ):
            raise ValueError(
                "keep at least 2 models; connections (per address too), deadline and timeout must be positive"
            )


@dataclass
class StoreStats:
    published: int = 0  # models hashed and stored
    bytes_published: int = 0
    evicted: int = 0


@dataclass
class ModelStore:
    """The last ``keep`` models by SHA-256, each published under ``url_base``; thread-safe (the
    HTTP server's threads read while the server's loop publishes). ``in_memory``: keep the bytes
    (what the built-in server serves); else only the folder holds them."""

    url_base: str
    keep: int = 16
    folder: Path | None = None
    in_memory: bool = True
    stats: StoreStats = field(default_factory=StoreStats)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: OrderedDict[str, bytes | None] = OrderedDict()
        # The arrays of recently published models -> their reference: a version's model is
        # hashed once, not per task. The entry holds the arrays, so their ids stay theirs.
        self._by_arrays: OrderedDict[tuple[int, ...], tuple[list[np.ndarray], wire.ModelRef]] = OrderedDict()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def ref(self, weights: np.ndarray, aux: dict[str, np.ndarray]) -> wire.ModelRef:
        """The reference of the model a task with ``weights`` and ``aux`` carries, published on
        first use. The orchestrator never writes a dispatched array in place (a new version is a
        new array), so arrays seen before are the same model."""
        arrays = [weights, *(v for _, v in sorted(aux.items()))]
        key = tuple(id(a) for a in arrays)
        hit = self._by_arrays.get(key)
        if hit is not None:
            self._by_arrays.move_to_end(key)
            return hit[1]
        body = wire.model_body(weights, aux)
        ref = wire.model_ref(body, self.url_base)
        self._publish(ref.sha256, body)
        self._by_arrays[key] = (arrays, ref)
        if len(self._by_arrays) > self.keep:
            self._by_arrays.popitem(last=False)
        return ref

    def get(self, sha256: str) -> bytes | None:
        """The bytes stored under ``sha256`` (None: not held, or only in the folder)."""
        with self._lock:
            return self._bodies.get(sha256)

    def _publish(self, sha256: str, body: bytes) -> None:
        if self.folder is not None:
            tmp = self.folder / f".{sha256}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, self.folder / sha256)  # a reader sees the whole file or none
        with self._lock:
            if sha256 in self._bodies:
                self._bodies.move_to_end(sha256)
                return
            self._bodies[sha256] = body if self.in_memory else None
            self.stats.published += 1
            self.stats.bytes_published += len(body)
            old = [self._bodies.popitem(last=False)[0] for _ in range(len(self._bodies) - self.keep)]
        self.stats.evicted += len(old)
        if self.folder is not None:
            for sha in old:
                (self.folder / sha).unlink(missing_ok=True)
