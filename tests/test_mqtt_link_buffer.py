"""The link's buffered socket reads (``felix.deploy.link._ReadBuffered``): paho's small reads are
served from one ``recv`` per chunk, ``pending()`` says what is buffered, and end of stream and
"no data yet" reach paho as they would from the socket itself."""

from __future__ import annotations

import itertools
import socket

import pytest

from felix.deploy.link import READ_CHUNK, _ReadBuffered


def test_small_reads_come_from_one_chunk_and_pending_tracks_them() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        buf = _ReadBuffered(b)
        with pytest.raises(BlockingIOError):  # nothing sent yet: paho's "try again"
            buf.recv(1)
        a.sendall(b"\x30\x05hello\x30\x02hi")
        assert buf.recv(1) == b"\x30" and buf.pending() == 10
        assert buf.recv(1) == b"\x05" and buf.recv(5) == b"hello"
        assert buf.recv(1) == b"\x30" and buf.recv(1) == b"\x02" and buf.recv(10) == b"hi"
        assert buf.pending() == 0
        big = bytes(range(256)) * (2 * READ_CHUNK // 256)
        a.sendall(big[:100])
        assert buf.recv(len(big)) == big[:100]  # a large body: read straight from the socket
        assert buf.fileno() == b.fileno()  # everything else is the socket's (select() needs this)
        a.close()
        assert buf.recv(1) == b""  # end of stream


def test_buffered_packet_peeks_at_whole_packets_only() -> None:
    """The link's fast path takes a packet from the buffer only when all of it is there; a packet
    cut by the chunk boundary (or a length still arriving) is left to paho's reads."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        buf = _ReadBuffered(b)
        long_body = bytes(200)  # remaining length 200: two length bytes (0xC8 0x01)
        a.sendall(b"\x32\x03abc" + b"\x40\xc8\x01" + long_body + b"\x30\x05hel")
        assert buf.recv(1) == b"\x32" and buf.recv(1) == b"\x03" and buf.recv(3) == b"abc"
        first, body, end = buf.buffered_packet()  # type: ignore[misc]
        assert first == 0x40 and body == long_body
        assert buf.buffered_packet() == (first, body, end)  # peeking consumes nothing
        buf.skip_to(end)
        assert buf.buffered_packet() is None  # 3 of its 5 body bytes are here
        assert buf.pending() == 5
        a.sendall(b"lo")
        assert buf.recv(2) == b"\x30\x05" and buf.recv(5) == b"hel"  # paho reads the rest itself
        assert buf.recv(5) == b"lo" and buf.pending() == 0
        a.sendall(b"\x30")
        assert buf.recv(1) == b"\x30" and buf.buffered_packet() is None  # an empty buffer


def test_a_network_thread_reads_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read pass that follows the last one sooner than ``READ_INTERVAL_S`` sleeps out the rest
    first (so what arrives meanwhile is taken in one pass); one after a pause reads at once."""
    import time

    import paho.mqtt.client as mqtt

    from felix.deploy.link import READ_INTERVAL_S, _Client

    starts: list[float] = []

    def fake_read(self: mqtt.Client, max_packets: int = 1) -> mqtt.MQTTErrorCode:
        starts.append(time.monotonic())
        return mqtt.MQTT_ERR_SUCCESS

    monkeypatch.setattr(mqtt.Client, "loop_read", fake_read)
    c = _Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t")
    t0 = time.monotonic()
    c.loop_read()
    assert starts[0] - t0 < READ_INTERVAL_S  # the first read: at once
    for _ in range(3):
        c.loop_read()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= READ_INTERVAL_S * 0.95, gaps
    time.sleep(2 * READ_INTERVAL_S)
    t1 = time.monotonic()
    c.loop_read()
    assert starts[-1] - t1 < READ_INTERVAL_S  # after a pause: at once


def test_drained_says_whether_the_last_read_took_all_the_socket_had() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        buf = _ReadBuffered(b)
        assert buf.drained  # nothing read yet: a first pass may wait
        with pytest.raises(BlockingIOError):
            buf.recv(1)
        assert buf.drained
        a.sendall(b"\x30\x05hello")
        assert buf.recv(2) == b"\x30\x05" and buf.drained  # a short chunk: the socket is empty
        big = bytes(3 * READ_CHUNK)
        a.sendall(big)
        assert buf.recv(5) == b"hello"  # from the buffer: no socket read
        assert buf.recv(READ_CHUNK) == bytes(READ_CHUNK) and not buf.drained  # a body read in full
        assert buf.recv(1) == b"\x00" and not buf.drained  # a full chunk: more may be waiting
        rest = 2 * READ_CHUNK - 1
        while rest:
            rest -= len(buf.recv(rest))
        assert not buf.drained  # a read that got all it asked for cannot tell ...
        with pytest.raises(BlockingIOError):
            buf.recv(1)
        assert buf.drained  # ... the next one, finding nothing, does


def test_a_pass_that_left_bytes_to_read_reads_on_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read interval applies only after a pass that emptied the socket: a link with a backlog,
    or with a large body arriving (over TLS a record per read), reads on without waiting."""
    import time

    import paho.mqtt.client as mqtt

    from felix.deploy.link import READ_INTERVAL_S, _Client

    starts: list[float] = []

    def fake_read(self: mqtt.Client, max_packets: int = 1) -> mqtt.MQTTErrorCode:
        starts.append(time.monotonic())
        return mqtt.MQTT_ERR_SUCCESS

    class Tls:  # what paho asks of an ssl.SSLSocket
        waiting = 0

        def pending(self) -> int:
            return self.waiting

    monkeypatch.setattr(mqtt.Client, "loop_read", fake_read)
    c = _Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t")
    a, b = socket.socketpair()
    with a, b:
        buffered = _ReadBuffered(b)
        buffered.drained = False
        tls = Tls()
        tls.waiting = 100
        cases: list[tuple[object, int]] = [(buffered, 0), (tls, 0), (Tls(), 0x30)]
        for sock, command in cases:
            c._sock = sock
            c._in_packet["command"] = command
            starts.clear()
            for _ in range(4):
                c.loop_read()
            gaps = [y - x for x, y in itertools.pairwise(starts)]
            assert max(gaps) < READ_INTERVAL_S / 2, (sock, command, gaps)
        c._sock, c._in_packet["command"] = Tls(), 0  # a TLS socket with nothing left: it waits
        starts.clear()
        for _ in range(3):
            c.loop_read()
        assert min(y - x for x, y in itertools.pairwise(starts)) >= READ_INTERVAL_S * 0.95
        c._sock = None
