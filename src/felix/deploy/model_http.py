"""The built-in model server of ``felix serve``: content-addressed GETs over HTTP, nothing else.

Clients fetch ``/<sha256>`` (64 lowercase hex digits) of a model the store holds
(``felix.deploy.model_store``); any other path, method or malformed request is refused with a
4xx status and the connection closed. It listens on loopback unless told otherwise, and every
client is hostile until proven otherwise, so each resource is bounded: at most
``max_connections`` at once and ``max_per_address`` of them from one address (one more is
answered 503 and closed at once: a requester that holds many connections open cannot take the
slots of everyone else's downloads), a request head of
at most ``MAX_HEAD`` bytes, ``io_timeout_s`` per read or write and ``deadline_s`` for the whole
connection (a client that sends its request or reads its answer slowly is cut off), one request
per connection. The bytes are immutable (their name is their hash), so any cache may keep them.
"""

from __future__ import annotations

import logging
import re
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from felix.deploy.model_store import ModelHosting, ModelStore

log = logging.getLogger("felix.deploy.model_http")

MAX_HEAD = 8192  # request line and headers
CHUNK = 64 * 1024
_PATH = re.compile(rb"/([0-9a-f]{64})")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@dataclass
class ServerStats:
    served: int = 0  # models sent whole
    bytes_served: int = 0
    # by reason: path, method, request, busy (all slots taken), address (its slots taken), slow
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1


class _Deadline(Exception):
    """The connection ran out of its time."""


class ModelServer:
    """Serves ``store``'s models on ``hosting.host``:``hosting.port`` from a thread per connection."""

    def __init__(self, store: ModelStore, hosting: ModelHosting) -> None:
        assert hosting.port is not None
        self.store = store
        self.hosting = hosting
        self.stats = ServerStats()
        self._open = 0  # connections being served
        self._per_address: dict[str, int] = {}  # address -> its connections being served
        self._lock = threading.Lock()
        self._tcp = _TCPServer((hosting.host, hosting.port), self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._tcp.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._tcp.serve_forever, args=(0.2,), name="model-http", daemon=True
        )
        self._thread.start()
        log.info("serving models on http://%s:%d", self.hosting.host, self.port)

    def close(self) -> None:
        if self._thread is not None:
            self._tcp.shutdown()
            self._thread.join(5.0)
        self._tcp.server_close()

    def _count(self, why: str) -> None:
        with self._lock:
            self.stats.refuse(why)

    def _enter(self, address: str) -> str | None:
        """Take a slot for a connection from ``address``; None, or why not (the refusal counted)."""
        with self._lock:
            why = None
            if self._open >= self.hosting.max_connections:
                why = "busy"
            elif self._per_address.get(address, 0) >= self.hosting.max_per_address:
                why = "address"
            if why is not None:
                self.stats.refuse(why)
                return why
            self._open += 1
            self._per_address[address] = self._per_address.get(address, 0) + 1
            return None

    def _leave(self, address: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._per_address[address] - 1
            if left:
                self._per_address[address] = left
            else:
                del self._per_address[address]

    # ------------------------------------------------------------------ one connection
    def handle(self, sock: socket.socket) -> None:
        end = time.monotonic() + self.hosting.deadline_s
        try:
            status, body = self._answer(self._read_head(sock, end))
            head = f"HTTP/1.1 {status} {_REASONS[status]}\r\nConnection: close\r\n"
            if status == 200:
                head += (
                    f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
                    "Cache-Control: public, max-age=31536000, immutable\r\n\r\n"
                )
            else:
                head += "Content-Length: 0\r\n\r\n"
                body = b""
            self._send(sock, head.encode(), end)
            self._send(sock, body, end)
            if status == 200:
                with self._lock:
                    self.stats.served += 1
                    self.stats.bytes_served += len(body)
        except _Deadline:
            self._count("slow")
        except OSError:  # the client went away
            self._count("closed")

    def _read_head(self, sock: socket.socket, end: float) -> bytes | None:
        """The request head (None: larger than ``MAX_HEAD``); _Deadline if it does not come in time."""
        head = b""
        while b"\r\n\r\n" not in head:
            if len(head) > MAX_HEAD:
                return None
            sock.settimeout(self._left(end))
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                raise _Deadline from None
            if not chunk:
                raise OSError("closed before its request was complete")
            head += chunk
        return head if head.index(b"\r\n\r\n") <= MAX_HEAD else None

    def _answer(self, head: bytes | None) -> tuple[int, bytes]:
        if head is None:
            self._count("request")
            return 431, b""
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._count("request")
            return 400, b""
        method, target = parts[0], parts[1]
        if method != b"GET":
            self._count("method")
            return 405, b""
        m = _PATH.fullmatch(target)
        body = None if m is None else self.store.get(m.group(1).decode())
        if body is None:
            self._count("path")
            return 404, b""
        return 200, body

    def _send(self, sock: socket.socket, data: bytes, end: float) -> None:
        view = memoryview(data)
        while view:
            sock.settimeout(self._left(end))
            try:
                n = sock.send(view[:CHUNK])
            except TimeoutError:
                raise _Deadline from None
            view = view[n:]

    def _left(self, end: float) -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise _Deadline
        return min(self.hosting.io_timeout_s, left)


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], owner: ModelServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self.owner._enter(str(client_address[0])) is not None:
            try:
                request.settimeout(0.5)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner._leave(str(client_address[0]))


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        self.server.owner.handle(self.request)
