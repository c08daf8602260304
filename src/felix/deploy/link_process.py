"""The server's link in a process of its own, so that its network threads leave the loop's interpreter.

At tens of thousands of messages a second the server's loop thread (the orchestrator) and the
link's network threads (paho's: one per broker shard) share one interpreter, and the loop spends
much of its time waiting for it while they read, frame and hand over messages. With
``ServeOptions.link_process`` the transport's own server link (``Transport.server_link``: one
MQTT connection, or one per shard) runs in a child process (``python -m
felix.deploy.link_process``: nothing of the server's process is copied or re-run; its options come
pickled over the child's stdin). :class:`LinkProcess` is the server's ``ServerLink`` over it.

What crosses, between this process and its own child only (frames of a length and a pickle):
- child -> server, on its stdout: the deliveries (address, payload, acknowledgement handle,
  origin, receipt time) and ``Connected`` notices, in the order each shard's network thread handed
  them over, in batches. A reader thread here builds the same ``Delivery``/``Connected`` items the
  server gets without the child and hands them to the server's sinks (its bounded inbox).
- child -> server, on a second pipe: its answer to ``start`` (connected, or the ``LinkError``
  text) and its state (each shard's connection, whether deliveries are set up), pushed on every
  change and twice a second as a heartbeat, so ``connected``, ``ready`` and ``connections`` are
  answered here without a round trip.
- server -> child, on its stdin: ``start``, ``send``, ``ack``, ``close``.

The child only frames what its transport received: every check (admission, the wire format, the
protocol) stays in the server. Exactly-once is unchanged: an acknowledgement reaches the broker
only after the server called ``ack`` (after its checkpoint; sent to the child in batches, within
``ACK_DELAY_S`` of a later call and before any close), through the shard and connection that
delivered the message (an older connection's acks are dropped there, as in one process).

Back-pressure runs through: a full inbox blocks the reader thread here, the pipe fills, and the
child's network threads, which write their own frames (one per read pass, as ``MqttLink._flush``
hands it over: no thread in between), wait on it, writing what is queued and a PINGREQ once per
keep-alive meanwhile (``felix.deploy.blocked``), exactly as they do on a full inbox in the server's
process; notices do not wait, as in the server's inbox (:class:`_Frames`). The state goes on its
own pipe, so a full data pipe delays neither the answer to ``start`` nor the heartbeat.

Nothing waits on the child without a bound: ``start`` within the connect timeouts, a command
written within ``timeout_s``; a child that exits, or sends no heartbeat for ``timeout_s``, makes
the next ``ready``/``send``/``ack`` raise ``LinkError`` (the server checks ``ready`` every turn),
which ends the server with that one line; ``close`` kills a child that has not exited in time. The
child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the server stops it,
after its last acknowledgements, and it exits by itself when the server's end of its stdin closes.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from felix.deploy.blocked import serve_waiting_link
from felix.deploy.channels import Address, Channel
from felix.deploy.inbox import WAIT_SLICE_S
from felix.deploy.link import Connected, LinkError
from felix.deploy.transport import Ack, Delivery, Item, ServerLink, ServerLinkArgs, get

log = logging.getLogger("felix.deploy.link_process")

_LEN = struct.Struct("<Q")
HEARTBEAT_S = 0.5  # the child reports its state at least this often
# Acknowledgements go to the child together: once this many wait, or the oldest waited this long
# (checked whenever the server calls the link, which its loop does every turn), and before any close.
ACK_BATCH = 1024
ACK_DELAY_S = 0.02
_CHANNELS = {c.value: c for c in Channel}
_PIPE_BYTES = 1 << 20  # each pipe's buffer, where the system allows (F_SETPIPE_SZ)


@dataclass(frozen=True)
class ChildOptions:
    """What the child is told on its stdin: the transport and its server link's arguments (less the
    sinks), and the server's log level."""

    transport: str
    run_id: str
    options: Any
    receive_maximum: int | None
    log_level: int


@dataclass(frozen=True)
class _State:
    connections: list[tuple[str, bool]]
    ready: bool
    refused: str | None  # ``ready()`` raised this LinkError in the child


# ---------------------------------------------------------------------- frames
def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def _read_frame(f: IO[bytes]) -> Any:
    """The next frame's object; EOFError at the end of the stream (or inside a frame)."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def _grow_pipe(fd: int) -> None:
    """A larger pipe buffer (fewer wake-ups per batch), if the system allows one."""
    try:
        import fcntl

        fcntl.fcntl(fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ (Linux)
    except (OSError, ImportError):
        pass


def _encode(items: list[Any]) -> list[tuple[Any, ...]]:
    """Deliveries and notices as plain tuples (a pickle of the dataclasses costs the reader twice as much)."""
    out: list[tuple[Any, ...]] = []
    for m in items:
        if isinstance(m, Delivery):
            a, k = m.address, m.ack
            ch, client = (a.channel.value, a.client) if a is not None else (None, 0)
            out.append((ch, client, m.payload, k.token, k.qos, k.epoch, k.shard, m.origin, m.received_at))
        else:
            assert isinstance(m, Connected), m
            out.append((m.epoch, m.session_present, m.shard))
    return out


def _decode(rows: list[tuple[Any, ...]]) -> list[Item]:
    return [
        Delivery(
            None if r[0] is None else Address(_CHANNELS[r[0]], r[1]),
            r[2],
            Ack(r[3], r[4], r[5], r[6]),
            r[7],
            r[8],
        )
        if len(r) == 9
        else Connected(r[0], r[1], r[2])
        for r in rows
    ]


# ---------------------------------------------------------------------- the server's end
class LinkProcess:
    """A ``ServerLink`` whose transport link runs in a child process (see the module's docstring).
    ``timeout_s``: how long a command may wait for the child to take it, and how long the child
    may stay silent, before the link counts as failed."""

    def __init__(
        self,
        transport: str,
        args: ServerLinkArgs,
        timeout_s: float = 30.0,
    ) -> None:
        get(transport)  # an unknown transport fails here, in the server, not in the child
        if transport == "memory":
            raise ValueError(
                "the in-memory transport cannot run in a link process: its broker is the server's process"
            )
        self.sink, self.batch_sink = args.sink, args.batch_sink
        self.timeout_s = timeout_s
        self._connect_timeout_s = float(getattr(args.options, "connect_timeout_s", 20.0))
        self._shards = max(1, len(getattr(args.options, "shards", ())))
        self._describe = str(args.options.describe())
        control_r, control_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "felix.deploy.link_process", str(control_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(control_w,),
        )
        os.close(control_w)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._to = self.proc.stdin.fileno()
        for fd in (self._to, self.proc.stdout.fileno(), control_r):
            _grow_pipe(fd)
        self._control = os.fdopen(control_r, "rb")
        self._write_lock = threading.Lock()
        self._gone_lock = threading.Lock()
        self._closing = False
        self._failure: str | None = None
        self._last_heard = time.monotonic()
        self._started = threading.Event()
        self._acks: list[tuple[int, int, int, int]] = []  # queued for the child (``ack``)
        self._acks_since = 0.0
        self._start_error: str | None = None
        self._state = _State([], False, None)
        self._readers = [
            threading.Thread(target=self._read_items, name="felix-link-items", daemon=True),
            threading.Thread(target=self._read_control, name="felix-link-control", daemon=True),
        ]
        for t in self._readers:
            t.start()
        os.set_blocking(self._to, False)
        opts = ChildOptions(
            transport,
            args.run_id,
            args.options,
            args.receive_maximum,
            logging.getLogger().getEffectiveLevel(),
        )
        self._command(opts)

    # ------------------------------------------------------------------ readers (threads of their own)
    def _read_items(self) -> None:
        """Hand the items of every frame waiting in the pipe to the server's sinks at once, in
        order: runs of deliveries together (``batch_sink``, which waits while the inbox is full),
        notices one by one. One read and one hand-over for all the frames that came meanwhile
        (the network threads write one per read pass) costs the server's interpreter less."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        try:
            while True:
                chunk = os.read(fd, _PIPE_BYTES)
                if not chunk:
                    raise EOFError
                buf += chunk
                rows: list[tuple[Any, ...]] = []
                pos = 0
                while len(buf) - pos >= _LEN.size:
                    (n,) = _LEN.unpack_from(buf, pos)
                    if len(buf) - pos - _LEN.size < n:
                        break
                    rows += pickle.loads(memoryview(buf)[pos + _LEN.size : pos + _LEN.size + n])
                    pos += _LEN.size + n
                del buf[:pos]
                items = _decode(rows)
                run: list[Delivery] = []
                for item in items:
                    if isinstance(item, Delivery):
                        run.append(item)
                        continue
                    if run:
                        self.batch_sink(run)
                        run = []
                    self.sink(item)
                if run:
                    self.batch_sink(run)
        except Exception as exc:  # noqa: BLE001 - the end of the stream, or a broken frame: the child is gone
            self._gone(exc)

    def _read_control(self) -> None:
        try:
            while True:
                kind, value = _read_frame(self._control)
                self._last_heard = time.monotonic()
                if kind == "state":
                    self._state = value
                elif kind == "start":
                    self._start_error = value
                    self._started.set()
                elif kind == "failed" and self._failure is None:
                    self._failure = value
        except Exception as exc:  # noqa: BLE001 - as above
            self._gone(exc)

    def _gone(self, exc: BaseException) -> None:
        with self._gone_lock:
            if self._closing or self._failure is not None:
                return
            self._failure = self._why_gone(exc)
        log.error("%s", self._failure)

    def _why_gone(self, exc: BaseException) -> str:
        try:
            code = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit code {code}" if code is not None else f"its output ended: {type(exc).__name__}"
        return f"the link process is gone ({how})"

    def _check(self) -> None:
        """Raise LinkError if the child is gone, failed or has been silent for ``timeout_s``."""
        if self._failure is None and time.monotonic() - self._last_heard > self.timeout_s:
            self._failure = f"the link process did not answer within {self.timeout_s:.0f} s"
        if self._failure is not None:
            raise LinkError(self._failure)

    def _command(self, obj: Any) -> None:
        """Write one command to the child, within ``timeout_s`` (LinkError otherwise)."""
        self._check()
        data = memoryview(_frame(obj))
        end = time.monotonic() + self.timeout_s
        with self._write_lock:
            while data:
                try:
                    n = os.write(self._to, data)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    self._gone(exc)
                    self._check()
                    raise LinkError(f"the link process is gone ({type(exc).__name__})") from None
                data = data[n:]
                if (
                    data
                    and not select.select([], [self._to], [], max(0.0, min(1.0, end - time.monotonic())))[1]
                ):
                    self._check()
                    if time.monotonic() >= end:
                        self._failure = (
                            f"the link process did not take a command within {self.timeout_s:.0f} s"
                        )
                        raise LinkError(self._failure)

    # ------------------------------------------------------------------ ServerLink
    @property
    def connected(self) -> bool:
        s = self._state
        return bool(s.connections) and all(up for _, up in s.connections)

    def start(self, fresh: bool, stop: threading.Event | None = None) -> None:
        """Connect in the child: bounded by the transport's connect timeouts (a reset and a
        connection per shard, in turn) and ``timeout_s`` more; a stop request ends the wait. A
        child that could not start says why before it exits: that line is the error."""
        try:
            self._command(("start", fresh))
            end = time.monotonic() + 2 * self._shards * self._connect_timeout_s + self.timeout_s
            while not self._started.wait(0.1):
                if stop is not None and stop.is_set():
                    raise LinkError(f"stopped while waiting for the broker at {self._describe}")
                if time.monotonic() > end:
                    self._failure = "the link process did not connect within its connect timeouts"
                self._check()
        except LinkError:
            self.close(timeout=1.0)
            if self._start_error is not None:
                raise LinkError(self._start_error) from None
            raise
        if self._start_error is not None:
            self.close(timeout=1.0)
            raise LinkError(self._start_error)

    def ready(self) -> bool:
        """Whether deliveries are set up; LinkError if the transport refused them, or if the child
        is gone or silent (the server asks every turn)."""
        self._check()
        self._flush_acks(force=False)
        s = self._state
        if s.refused is not None:
            raise LinkError(s.refused)
        return s.ready

    def send(self, channel: Channel, client: int | None, payload: bytes) -> None:
        self._command(("send", channel.value, client, payload))
        self._flush_acks(force=False)

    def ack(self, acks: list[Ack]) -> None:
        """Queue acknowledgements for the child: they leave with the next batch (``ACK_BATCH``,
        ``ACK_DELAY_S``: one command, and one wake-up of the child, per batch rather than per
        call of the loop), never before the server asked, and all of them before a close."""
        if acks:
            if not self._acks:
                self._acks_since = time.monotonic()
            self._acks += [(a.token, a.qos, a.epoch, a.shard) for a in acks]
        self._flush_acks(force=False)

    def _flush_acks(self, force: bool) -> None:
        if self._acks and (
            force or len(self._acks) >= ACK_BATCH or time.monotonic() - self._acks_since >= ACK_DELAY_S
        ):
            acks, self._acks = self._acks, []
            self._command(("ack", acks))

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to close its link (after the commands before, acknowledgements included)
        and exit; a child still running ``timeout`` s later (plus a margin) is killed."""
        answering = self.proc.poll() is None and self._failure is None
        self._closing = True  # the end of the child's output is expected from here on
        if answering:
            try:
                self._flush_acks(force=True)
                self._command(("close", timeout))
            except LinkError:
                answering = False
        try:
            self.proc.wait(timeout + 2.0 if answering else 0.0)
        except subprocess.TimeoutExpired:
            log.warning("the link process did not exit within %.0f s; killed", timeout + 2.0)
            self.proc.kill()
            self.proc.wait(5.0)
        for t in self._readers:
            t.join(2.0)
        for f in (self.proc.stdin, self.proc.stdout, self._control):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def connections(self) -> list[tuple[str, bool]]:
        return list(self._state.connections)


# ---------------------------------------------------------------------- the child
class _Frames:
    """The child's stdout: each hand-over of a network thread written as one frame, by that
    thread, so nothing stands between a read pass and the server's reader. A write that finds the
    pipe full waits in slices (``WAIT_SLICE_S``), and each slice runs the waiting link's upkeep
    (``felix.deploy.blocked``: what is queued and a PINGREQ when due), as a put into a full inbox
    does in the server's process. A ``Connected`` notice never waits (paho's connect callback is
    no place to): it goes out at once if the pipe takes it, else ahead of the next frame or the
    next heartbeat, which keeps its order behind what its connection delivered before it (written
    already) and ahead of what the connection delivers next."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._lock = threading.Lock()
        self._notices: list[Connected] = []
        self._notices_lock = threading.Lock()
        self.broken = False  # the server's end is gone: what follows is dropped

    def batch(self, items: list[Delivery]) -> bool:
        return self._write(_encode(items))

    def one(self, item: Item) -> None:
        if isinstance(item, Connected):
            with self._notices_lock:
                self._notices.append(item)
            if self._lock.acquire(blocking=False):
                try:
                    self._flush_notices()
                finally:
                    self._lock.release()
        else:
            self._write(_encode([item]))

    def notices(self) -> None:
        """Try again to write the notices that did not go out at once (the heartbeat's thread,
        which must not wait: a full pipe would stop the heartbeat; the next frame takes them then)."""
        if self._notices and self._lock.acquire(blocking=False):
            try:
                self._flush_notices()
            finally:
                self._lock.release()

    def _flush_notices(self) -> None:
        """The notices in one frame if the pipe takes all of it now (a write of at most PIPE_BUF
        bytes to a pipe is whole or nothing), holding the lock."""
        with self._notices_lock:
            if not self._notices or self.broken:
                return
            data = _frame(_encode(self._notices))
            if len(data) > select.PIPE_BUF:
                return
            try:
                os.write(self.fd, data)
            except BlockingIOError:
                return
            except OSError:
                self.broken = True
                return
            self._notices = []

    def _write(self, rows: list[tuple[Any, ...]]) -> bool:
        while not self._lock.acquire(timeout=WAIT_SLICE_S):
            serve_waiting_link()
        try:
            if self.broken:
                return False
            with self._notices_lock:
                rows = _encode(self._notices) + rows
                self._notices = []
            data = memoryview(_frame(rows))
            served = time.monotonic()
            while data:
                try:
                    data = data[os.write(self.fd, data) :]
                    continue
                except BlockingIOError:
                    select.select([], [self.fd], [], WAIT_SLICE_S)
                except OSError:
                    self.broken = True
                    return False
                if time.monotonic() - served >= WAIT_SLICE_S:
                    serve_waiting_link()
                    served = time.monotonic()
            return True
        finally:
            self._lock.release()


class _Child:
    """The child's side: the transport's server link, writing to the server through
    :class:`_Frames`, and a thread that reports its state (and writes late notices)."""

    def __init__(self, opts: ChildOptions, data_fd: int, control: IO[bytes]) -> None:
        self.frames = _Frames(data_fd)
        self.link: ServerLink = get(opts.transport).server_link(
            ServerLinkArgs(
                opts.run_id, opts.options, opts.receive_maximum, self.frames.one, self.frames.batch
            )
        )
        self.control = control
        self.stop = threading.Event()  # close asked: a start in progress gives up
        self.closed = threading.Event()  # the link is closed: the reporter ends
        self._control_lock = threading.Lock()
        self._starting: threading.Thread | None = None
        self._reporter = threading.Thread(target=self._report, name="felix-link-state", daemon=True)
        self._reporter.start()

    def _tell(self, kind: str, value: Any) -> None:
        with self._control_lock:
            self.control.write(_frame((kind, value)))
            self.control.flush()

    def _state(self) -> _State:
        try:
            return _State(self.link.connections(), self.link.ready(), None)
        except LinkError as exc:
            return _State(self.link.connections(), False, str(exc))

    def _report(self) -> None:
        """The state on every change, and at least every ``HEARTBEAT_S`` (the server's sign of life)."""
        last: _State | None = None
        sent = 0.0
        try:
            while not self.closed.is_set():
                s = self._state()
                if s != last or time.monotonic() - sent >= HEARTBEAT_S:
                    self._tell("state", s)
                    last, sent = s, time.monotonic()
                self.frames.notices()
                self.closed.wait(0.05)
        except OSError:
            pass

    def _start(self, fresh: bool) -> None:
        try:
            self.link.start(fresh, self.stop)
        except LinkError as exc:
            self._tell("start", str(exc))
        except Exception as exc:  # noqa: BLE001 - the server hears why, in one line
            self._tell("start", f"the link process could not start: {type(exc).__name__}: {exc}")
        else:
            self._tell("start", None)

    def serve(self, commands: IO[bytes]) -> None:
        """Run the server's commands until ``close`` or the end of its stdin."""
        timeout = 1.0
        while True:
            try:
                cmd = _read_frame(commands)
            except EOFError:
                break  # the server is gone
            kind = cmd[0]
            try:
                if kind == "send":
                    self.link.send(_CHANNELS[cmd[1]], cmd[2], cmd[3])
                elif kind == "ack":
                    self.link.ack([Ack(*a) for a in cmd[1]])
            except (LinkError, ValueError) as exc:  # raised to the server's loop, as in one process
                self._tell("failed", str(exc))
            if kind == "start":
                self._starting = threading.Thread(target=self._start, args=(cmd[1],), daemon=True)
                self._starting.start()
            elif kind == "close":
                timeout = float(cmd[1])
                break
        self.stop.set()
        if self._starting is not None:
            self._starting.join(timeout)
        self.link.close(timeout)
        self.closed.set()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops this process, after its last acks
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    data = os.dup(1)
    os.dup2(2, 1)  # anything printed by mistake goes to stderr, not into the frames
    control = os.fdopen(int(sys.argv[1]), "wb")
    commands = sys.stdin.buffer
    opts = _read_frame(commands)
    assert isinstance(opts, ChildOptions), type(opts)
    logging.basicConfig(
        level=opts.log_level, format="%(asctime)s %(levelname)s %(name)s (link process): %(message)s"
    )
    try:
        child = _Child(opts, data, control)
    except Exception as exc:  # noqa: BLE001 - the server's start says why, in one line
        control.write(
            _frame(("start", f"the link process could not build its link: {type(exc).__name__}: {exc}"))
        )
        control.flush()
        os._exit(1)
    child.serve(commands)
    try:
        control.close()
    except OSError:
        pass
    os._exit(0)  # network threads left behind (a stuck close) must not hold the exit


if __name__ == "__main__":
    # The module's own classes, not ``__main__``'s: the frames pickle them by their module's name.
    from felix.deploy.link_process import main as _main

    _main()
