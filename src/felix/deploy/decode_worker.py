"""A process that parses the server's inbound messages, so that two cores share the intake.

The server's loop thread owns the orchestrator, and with it every inbound message's handling:
the sender's budgets, the wire format's checks, the protocol's and the orchestrator's. The wire
format's checks (``felix.deploy.wire.parse``: sizes, the JSON header, every field's range, the
arrays' layout) need no state, so with ``ServeOptions.decode_worker`` they run here instead, on a
batch of messages while the loop applies the batch before it. What comes back is, for a message
that carries arrays (a result), the checked header (``wire.Parsed``: plain values, cheap to
pickle), which the loop builds on its own copy of the bytes (array views, no copy); for one that
carries none (a tier report, a registration), the message itself, built here (it unpickles in
less time than its header and its building in the loop take); or the refusal; each with the
time it took here. The loop checks the rest and charges that time to the sender's cost budget. The sender's budgets are checked in
the loop before a message is sent here (a login in debt is refused unread, as without the
worker), so the worker's time is bounded by the budgets too.

One batch is in flight at a time and results come back in order, so messages are applied in
the order they arrived; the worker answers each batch within ``timeout_s`` or the server stops
with a clear error (it would rather stop than apply messages out of order or hang).
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any

from felix.core.refusals import Refusal
from felix.deploy import wire

Parsed = wire.Parsed | wire.Message | wire.MessageError


class DecodeWorkerError(RuntimeError):
    """The decode worker died or did not answer in time."""


_LEN = struct.Struct("<Q")


class DecodeWorker:
    """The worker process (``python -m felix.deploy.decode_worker``: nothing of the server's
    process is copied or re-run) and its pipes: :meth:`submit` a batch, :meth:`collect` its
    results. Frames are a length and a pickle, between this process and its own child only."""

    def __init__(self, max_bytes: int, max_header_bytes: int, timeout_s: float = 30.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "felix.deploy.decode_worker", str(max_bytes), str(max_header_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to, self._from = self._proc.stdin, self._proc.stdout.fileno()
        self.timeout_s = timeout_s
        self.in_flight = 0  # messages submitted and not yet collected

    def submit(self, payloads: list[bytes]) -> None:
        if self.in_flight:
            raise DecodeWorkerError("a batch is already in flight")
        try:
            _send(self._to, payloads)
        except OSError as exc:
            raise DecodeWorkerError(f"the decode worker is gone ({type(exc).__name__})") from None
        self.in_flight = len(payloads)

    def collect(self) -> list[tuple[Parsed, float]]:
        """The results of the batch in flight, in order: each parsed header (a message with
        arrays), message (one without) or refusal, and the CPU seconds it took."""
        if not self.in_flight:
            return []
        end = time.monotonic() + self.timeout_s
        (n,) = _LEN.unpack(self._read(_LEN.size, end))
        raw: list[tuple[Any, float]] = pickle.loads(self._read(n, end))
        self.in_flight = 0
        return [(_result(r), s) for r, s in raw]

    def _read(self, n: int, end: float) -> bytes:
        parts, got = [], 0
        while got < n:
            if not select.select([self._from], [], [], max(0.0, end - time.monotonic()))[0]:
                raise DecodeWorkerError(f"the decode worker did not answer within {self.timeout_s:.0f} s")
            chunk = os.read(self._from, n - got)
            if not chunk:
                raise DecodeWorkerError(f"the decode worker is gone (exit code {self._proc.poll()})")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        try:
            self._to.close()  # the worker's end of input: it exits
        except OSError:
            pass
        try:
            self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(2.0)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _send(out: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LEN.pack(len(data)))
    out.write(data)
    out.flush()


def _result(r: Any) -> Parsed:
    if not isinstance(r, tuple):
        return r  # type: ignore[no-any-return]
    code, detail = r  # a MessageError does not pickle (its constructor takes two arguments)
    return wire.MessageError(Refusal(code), detail)


def _decode(payload: bytes, max_bytes: int, max_header_bytes: int) -> Parsed:
    """``wire.parse``; and ``wire.build`` too for a message that carries no arrays (no result
    does without its header's values: its aux entries are the loop's to check)."""
    parsed = wire.parse(payload, max_bytes, max_header_bytes)
    if parsed.layout == () and parsed.mtype is not wire.MsgType.RESULT:
        return wire.build(parsed, payload)
    return parsed


def _work(inp: IO[bytes], out_: IO[bytes], max_bytes: int, max_header_bytes: int) -> None:
    while True:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            return  # the server closed its end
        batch: list[bytes] = pickle.loads(inp.read(_LEN.unpack(head)[0]))
        out: list[tuple[Any, float]] = []
        for payload in batch:
            t0 = time.thread_time()
            try:
                r: Any = _decode(payload, max_bytes, max_header_bytes)
            except wire.MessageError as exc:
                r = (exc.code.value, exc.detail)
            except Exception as exc:  # noqa: BLE001 - no client message may end the worker
                r = (Refusal.INTERNAL.value, f"parsing raised {type(exc).__name__}: {str(exc)[:200]}")
            out.append((r, time.thread_time() - t0))
        _send(out_, out)


if __name__ == "__main__":
    _work(sys.stdin.buffer, sys.stdout.buffer, int(sys.argv[1]), int(sys.argv[2]))
