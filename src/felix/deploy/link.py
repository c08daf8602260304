"""One MQTT connection (paho-mqtt, v2 callback API, MQTT 5) as the runtime uses it.

Threading contract: paho's network thread runs the callbacks, and they only hand items to the
owner: a ``Connected`` per (re)connection to ``sink``, and the ``Inbound`` messages of each read
pass to ``batch_sink`` at once (or to ``sink`` one by one without it). All logic runs on the
owner's single loop thread, which is what the sans-I/O orchestrator needs (it is not thread
safe). ``publish``, ``ack`` and ``ack_many`` may be called from that loop thread.

Acknowledgements: paho acknowledges nothing by itself. Without ``manual_ack`` the link sends the
PUBACKs of a read pass once the owner has taken its messages (one write for all of them); with
it, the owner acknowledges when it chooses (``ack_many``: one write per call).

One file of about 710 lines on purpose: the threading contract above holds across the
connection's whole life (connect, reconnect, read passes, acknowledgements, close), and splitting
it would spread one lock discipline over several modules.

Sessions: a process that starts fresh first discards any session the broker still holds for its
client id (a short clean-start connection), then always connects with ``clean_start=False`` and a
session expiry, so that subscriptions and queued QoS 1 messages survive reconnects and broker
restarts. (Mosquitto 2.0 does not persist a session across a broker restart while it is still
marked clean-start, hence the separate reset connection rather than MQTT's clean-start-first-only.)
paho reconnects on its own with a bounded back-off and resends unacknowledged QoS 1 messages;
publishing while disconnected queues the message in paho.

Identity: a link's MQTT client id is its login (the broker enforces it with
``use_username_as_clientid``), so no client can connect under the server's id, or another
client's, and take over that session.

TLS: a certificate that does not name the host in ``--broker`` (or an unknown CA) is reported as
such, at once on a fresh start and after the connect timeout otherwise (paho's network thread
retries silently; ``_tls_problem`` then repeats the handshake to say why).

Keep-alive under back-pressure: a read pass handed to an owner whose inbox is full makes the
network thread wait (that is the back-pressure), and while it waits the inbox has it write what
is queued and a PINGREQ every half keep-alive (``felix.deploy.blocked``, ``MqttLink._upkeep``);
bytes waiting unread in the socket count as the broker's sign of life. So the keep-alive does
not depend on the inbox: an owner that is behind for minutes keeps its connections, instead of
having the broker drop them and redeliver everything unacknowledged on each reconnect.

``manual_ack=True`` lets the owner acknowledge a message only once its effect is durable (the
server acks after its checkpoint), so the broker redelivers anything the server had not saved.
Acks belong to the connection a message arrived on: after a reconnect the broker redelivers
every unacknowledged message, so acks of an older connection are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from felix.deploy.blocked import keeping_alive

log = logging.getLogger("felix.deploy.link")


READ_CHUNK = 65536  # bytes read from the socket at once by a link's network thread
BUFFERED_PACKETS_PER_READ = 256  # packets handled per select() when they are already buffered
FLUSH_BYTES = 1 << 20  # a read pass hands its messages over once they hold this many payload bytes
# A network thread whose last read pass emptied the socket reads at most once per this interval:
# one woken sooner sleeps out the rest first (``_Client.loop_read``), so that a busy link takes what
# arrived meanwhile in one read pass, and an idle one reads at once. A pass that left bytes to read
# (a backlog, a body larger than a read chunk, TLS records) is followed at once. At 10,000 tier
# messages/s over six brokers, 5 ms cut the six network threads from 33-37% of a core to 25-26%
# and the loop's waits for the interpreter lock from 19% of its time to 11-12%
# (docs/deployment.md, "100,000 clients"), for at most 5 ms of delay.
READ_INTERVAL_S = 0.005
_PUBACK = struct.Struct("!BBH")


class _ReadBuffered:
    """A plain TCP socket whose reads are served from a buffer filled ``READ_CHUNK`` bytes at a time.

    paho reads a packet with three to five ``recv`` calls (the command byte, the length byte by
    byte, the body) and handles one packet per ``select()``: at thousands of small messages per
    second those system calls, each a GIL release and re-acquire, were most of the server's network
    thread (203 us of CPU per tier report at 2,000/s). Here one ``recv`` fills the buffer;
    ``pending()``, which paho asks of TLS sockets, tells its loop that buffered bytes are there
    without waiting in ``select()``. Everything else is the socket's own.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""
        self._pos = 0
        # The last read from the socket took all it had (fewer bytes than asked, or none): until
        # more arrives there is nothing to read, so the next read pass may wait (``_Client.loop_read``).
        self.drained = True

    def recv(self, n: int) -> bytes:
        if self._pos >= len(self._buf):
            if n >= READ_CHUNK:  # a large body: straight into the caller's chunk
                return self._read(n)
            self._buf = self._read(READ_CHUNK)
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        if self._pos >= len(self._buf):  # hold no consumed chunk (a process runs hundreds of links)
            self._buf, self._pos = b"", 0
        return out

    def _read(self, n: int) -> bytes:
        self.drained = True
        data = self._sock.recv(n)  # BlockingIOError when empty, b"" at EOF
        self.drained = len(data) < n
        return data

    def pending(self) -> int:
        return len(self._buf) - self._pos

    def buffered_packet(self) -> tuple[int, bytes, int] | None:
        """``(first byte, body, end)`` of the packet at the read position if all of it is buffered
        (nothing is consumed: ``skip_to(end)`` does), else None."""
        buf, pos = self._buf, self._pos
        n = len(buf)
        length, shift, i = 0, 0, pos + 1
        while True:
            if i >= n or shift > 21:  # not buffered yet, or a malformed length (paho reports it)
                return None
            b = buf[i]
            length |= (b & 0x7F) << shift
            shift += 7
            i += 1
            if not b & 0x80:
                break
        end = i + length
        return (buf[pos], buf[i:end], end) if end <= n else None

    def skip_to(self, end: int) -> None:
        self._pos = end
        if end >= len(self._buf):
            self._buf, self._pos = b"", 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


class _Client(mqtt.Client):
    """paho's client with buffered reads on plain TCP (``_ReadBuffered``), and, after each
    ``select()``, every packet already buffered handled (up to ``BUFFERED_PACKETS_PER_READ``).
    TLS sockets keep paho's own reads (their ``pending()`` already works this way).

    With an ``intake`` (the ``MqttLink`` that owns it), a PUBLISH without MQTT 5 properties at
    QoS 0 or 1 (every message this project sends) is parsed here straight into the intake: paho's
    own path builds an ``MQTTMessage``, a ``Properties`` object (a table of every MQTT 5 property,
    rebuilt per message) and walks its topic matcher, which was most of the network thread's CPU per
    tier report. Anything else (QoS 2, properties, a malformed packet) takes paho's path. At the end
    of each read pass the intake hands everything received over at once (``MqttLink._flush``)."""

    intake: MqttLink | None = None
    _last_read = 0.0

    def _create_socket(self) -> Any:
        sock = super()._create_socket()
        return (
            _ReadBuffered(sock)
            if isinstance(sock, socket.socket) and not isinstance(sock, ssl.SSLSocket)
            else sock
        )

    def loop_read(self, max_packets: int = 1) -> mqtt.MQTTErrorCode:
        if self._drained():
            nap = self._last_read + READ_INTERVAL_S - time.monotonic()
            if nap > 0:
                time.sleep(nap)
        self._last_read = time.monotonic()
        try:
            rc = super().loop_read(max_packets)
            for _ in range(BUFFERED_PACKETS_PER_READ):
                sock = self._sock
                if rc != mqtt.MQTT_ERR_SUCCESS or not isinstance(sock, _ReadBuffered) or not sock.pending():
                    break
                if not self._take_buffered_publishes(sock):
                    rc = super().loop_read(max_packets)
            return rc
        finally:
            if self.intake is not None:
                self.intake._flush()

    def _drained(self) -> bool:
        """Whether the last read pass took all there was, so that the next may wait: a backlog, or
        a stream of bodies larger than a chunk (each read straight from the socket, one per pass),
        is read on at once. A TLS socket yields a record per read: one with decrypted bytes
        waiting, or half-way through a packet, reads on too."""
        sock = self._sock
        if isinstance(sock, _ReadBuffered):
            return sock.drained
        pending = getattr(sock, "pending", None)  # an ssl.SSLSocket's decrypted bytes
        return self._in_packet["command"] == 0 and not (pending is not None and pending())

    def _take_buffered_publishes(self, sock: _ReadBuffered) -> int:
        """Hand the intake every PUBLISH wholly in the read buffer, up to the first packet that is
        not one the fast path takes (paho reads that one); how many it took."""
        intake = self.intake
        if intake is None or self._in_packet["command"] != 0:  # paho is half-way through a packet
            return 0
        v5 = self._protocol == mqtt.MQTTv5
        taken = 0
        while (whole := sock.buffered_packet()) is not None:
            first, body, end = whole
            qos = (first >> 1) & 0x03
            parsed = parse_publish(body, qos, v5) if first >> 4 == 3 and qos < 2 else None
            if parsed is None:
                break
            sock.skip_to(end)
            intake._received(parsed[0], parsed[2], parsed[1], qos, bool(first & 0x08))
            taken += 1
        if taken:
            with self._msgtime_mutex:
                self._last_bytes_received = mqtt.time_func()
        return taken

    def _handle_publish(self) -> mqtt.MQTTErrorCode:
        intake = self.intake
        command = self._in_packet["command"]
        qos = (command >> 1) & 0x03
        parsed = (
            None
            if intake is None or qos == 2
            else parse_publish(self._in_packet["packet"], qos, self._protocol == mqtt.MQTTv5)
        )
        if parsed is None:
            return super()._handle_publish()
        topic, mid, payload = parsed
        assert intake is not None
        intake._received(topic, payload, mid, qos, bool(command & 0x08))
        return mqtt.MQTT_ERR_SUCCESS


def parse_publish(packet: bytes | bytearray, qos: int, v5: bool) -> tuple[str, int, bytes] | None:
    """``(topic, packet id, payload)`` of a PUBLISH body at QoS 0 or 1 that carries no MQTT 5
    properties; None for anything else (the caller leaves it to paho, which reports what is wrong)."""
    n = len(packet)
    if n < 2:
        return None
    end = 2 + ((packet[0] << 8) | packet[1])
    pos = end
    mid = 0
    if qos:
        if pos + 2 > n:
            return None
        mid = (packet[pos] << 8) | packet[pos + 1]
        pos += 2
    if v5:
        if pos >= n or packet[pos] != 0:  # property length 0, one byte
            return None
        pos += 1
    try:
        topic = packet[2:end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return topic, mid, bytes(packet[pos:])


def _published(info: mqtt.MQTTMessageInfo) -> bool:
    """Whether the broker acknowledged a publish; one made while disconnected counts as done here
    (paho's ``is_published`` raises for it: close waits for nothing it could still send)."""
    try:
        return info.is_published()
    except RuntimeError:
        return True


class LinkError(ConnectionError):
    """The broker could not be reached or refused us (bad credentials, not authorised)."""


@dataclass(frozen=True)
class BrokerOptions:
    """The MQTT transport's options (``felix.deploy.transport.LinkOptions``; ``--link KEY=VALUE``
    sets any of them, ``--broker``, ``--username``/``--password`` and ``--tls-*`` are shorthands)."""

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None  # CA bundle: turns TLS on
    tls_cert: str | None = None  # optional client certificate (mutual TLS)
    tls_key: str | None = None
    keepalive_s: int = 20
    session_expiry_s: int = 86400
    reconnect_min_s: float = 0.25
    reconnect_max_s: float = 4.0
    connect_timeout_s: float = 20.0
    # MQTT 5's Receive Maximum: QoS 1 messages the broker may have in flight to this connection
    # (Mosquitto 2.0 honours it over its max_inflight_messages). None: the broker's setting.
    receive_maximum: int | None = None
    # Sharded brokers (``felix.deploy.shards``): every broker's (host, port) in shard order, the
    # first being ``host``/``port``; empty for one broker. Logins and TLS settings are shared.
    shards: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        """TLS files are loaded once here, so a missing or unreadable CA, certificate or key is a
        ValueError naming it at start-up, not an ``ssl`` traceback from the first connection."""
        if self.tls_ca is None:
            if self.tls_cert is not None or self.tls_key is not None:
                raise ValueError("a TLS client certificate or key needs a CA (tls_ca) as well")
            return
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a TLS client certificate and its key go together (tls_cert and tls_key)")
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise ValueError(f"TLS CA file {self.tls_ca}: {exc.strerror or exc}") from None
        if self.tls_cert is not None:
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            except OSError as exc:
                raise ValueError(
                    f"TLS certificate {self.tls_cert} / key {self.tls_key}: {exc.strerror or exc}"
                ) from None

    @property
    def secure(self) -> bool:
        return self.tls_ca is not None

    def describe(self) -> str:
        return self.address

    def with_login(self, username: str | None, password: str | None) -> BrokerOptions:
        return dataclasses.replace(self, username=username, password=password)

    @staticmethod
    def parse_address(text: str) -> tuple[str, int]:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"broker address {text!r} must be HOST:PORT")
        return host, int(port)

    @staticmethod
    def parse_addresses(text: str) -> list[tuple[str, int]]:
        """``HOST:PORT`` or a comma-separated list of them (one broker per shard, each once)."""
        addresses = [BrokerOptions.parse_address(a.strip()) for a in text.split(",")]
        if len(set(addresses)) < len(addresses):
            raise ValueError(f"broker list {text!r} names a broker twice")
        return addresses

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the broker, or of every shard's, comma-separated (for logs and summaries)."""
        return ",".join(f"{h}:{p}" for h, p in self.shards or ((self.host, self.port),))


@dataclass(frozen=True, slots=True)
class Inbound:
    topic: str
    payload: bytes
    mid: int
    qos: int
    dup: bool
    epoch: int  # which connection of this link it arrived on (for acks)
    received_at: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class Connected:
    epoch: int  # the connection's number, counted per shard
    session_present: bool
    shard: int = 0  # which broker of a sharded deployment (``felix.deploy.shards``)


Sink = Callable[[Inbound | Connected], None]
BatchSink = Callable[[list[Inbound]], bool]  # False: the batch was dropped (the owner is closing)


class MqttLink:
    """One connection. Its MQTT client id is its login (``opts.username``), as the broker enforces
    with ``use_username_as_clientid``: a client cannot claim another's id (the server's least of
    all) and so cannot take over or wipe its session. ``client_id`` is used only without a login."""

    def __init__(
        self,
        client_id: str,
        opts: BrokerOptions,
        subscriptions: list[str],
        sink: Sink,
        manual_ack: bool = False,
        batch_sink: BatchSink | None = None,
    ) -> None:
        self.client_id = opts.username if opts.username is not None else client_id
        self.opts = opts
        self.subscriptions = list(subscriptions)
        self.sink = sink
        self.batch_sink = batch_sink
        self.manual_ack = manual_ack
        self.epoch = 0
        self._first = threading.Event()
        self._refused: str | None = None
        # The first connection's SUBACK: ``start`` returns once the subscriptions are in place, so
        # nothing published to them right after is lost (and a refused one is an error, not silence).
        self._subscribed = threading.Event()
        self._sub_mid: int | None = None
        self._sub_refused: str | None = None
        self._rx: list[Inbound] = []  # received in the current read pass (network thread only)
        self._rx_acks: list[int] = []  # ... and the packet ids to acknowledge once they are handed over
        self._rx_bytes = 0
        # A read pass is being handed to the owner and acknowledged (set by the network thread):
        # ``close`` lets it finish, so what the owner took is acknowledged before the DISCONNECT.
        self._handing_over = False
        self.upkeeps = 0  # times the network thread kept the connection alive while its owner was full
        # paho never acknowledges by itself: the link does, after the owner has the message
        # (``manual_ack=False``), or the owner does, once the message's effect is durable.
        self._client = self._new_client(True)
        self._client.intake = self
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._will_builder: Callable[[int], tuple[str, bytes]] | None = None
        self._will_delay = 0
        self._last_publish: mqtt.MQTTMessageInfo | None = None

    def _new_client(self, manual_ack: bool) -> _Client:
        c = _Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=manual_ack,
        )
        o = self.opts
        if o.username is not None:
            c.username_pw_set(o.username, o.password)
        if o.tls_ca is not None:
            c.tls_set(ca_certs=o.tls_ca, certfile=o.tls_cert, keyfile=o.tls_key, cert_reqs=ssl.CERT_REQUIRED)
        c.reconnect_delay_set(o.reconnect_min_s, o.reconnect_max_s)  # type: ignore[arg-type]  # floats work
        c.max_inflight_messages_set(1000)
        return c

    def set_will(self, builder: Callable[[int], tuple[str, bytes]], delay_s: int = 5) -> None:
        """Last will, rebuilt for every connection (``builder(epoch)`` -> topic, payload) so that
        each connection's will carries its own message id. Sent by the broker ``delay_s`` after
        an unclean disconnect, unless the client is back within that time."""
        self._will_builder = builder
        self._will_delay = delay_s
        self._arm_will(self.epoch + 1)

    def _arm_will(self, epoch: int) -> None:
        if self._will_builder is None:
            return
        topic, payload = self._will_builder(epoch)
        props = Properties(PacketTypes.WILLMESSAGE)
        props.WillDelayInterval = self._will_delay
        self._client.will_set(topic, payload, qos=1, properties=props)

    # ------------------------------------------------------------------ lifecycle
    def start(self, fresh: bool, wait_subscribed: bool = True, stop: threading.Event | None = None) -> None:
        """Connect (blocking until the first CONNACK, bounded) and start the network thread.

        ``wait_subscribed``: also wait for the SUBACK. An owner that cannot wait (a resumed server:
        the broker delivers its queued backlog before the SUBACK, and the network thread then waits
        for room in the owner's inbox) passes False and drains its inbox while it checks
        :meth:`subscribed` within ``connect_timeout_s``. ``stop``: a stop request ends the wait
        (a LinkError saying so)."""
        if fresh:
            self._reset_session(stop)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.opts.session_expiry_s
        if self.opts.receive_maximum is not None:
            props.ReceiveMaximum = self.opts.receive_maximum
        try:
            self._client.connect_async(
                self.opts.host, self.opts.port, self.opts.keepalive_s, clean_start=False, properties=props
            )
        except (OSError, ValueError) as exc:
            raise LinkError(f"cannot connect to {self.opts.host}:{self.opts.port}: {exc}") from None
        self._client.loop_start()
        if not self._wait(self._first, stop):
            self.close()
            raise LinkError(
                self._tls_problem()
                or f"no answer from the broker at {self.opts.host}:{self.opts.port} "
                f"within {self.opts.connect_timeout_s:.0f} s"
            )
        if self._refused is not None:
            self.close()
            raise LinkError(
                f"the broker at {self.opts.host}:{self.opts.port} refused {self.client_id!r}: {self._refused}"
            )
        if wait_subscribed and (not self._wait(self._subscribed, stop) or self._sub_refused is not None):
            self.close()
            raise self._subscription_error()

    def _wait(self, event: threading.Event, stop: threading.Event | None) -> bool:
        """Wait up to ``connect_timeout_s`` for ``event``; a stop request ends the wait (LinkError)."""
        deadline = time.monotonic() + self.opts.connect_timeout_s
        while not event.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if stop is not None and stop.is_set():
                self.close()
                raise LinkError(f"stopped while waiting for the broker at {self.opts.host}:{self.opts.port}")
            if time.monotonic() >= deadline:
                return False
        return True

    def subscribed(self) -> bool:
        """Whether the broker confirmed the first connection's subscriptions (LinkError if it
        refused them)."""
        if self._sub_refused is not None:
            raise self._subscription_error()
        return self._subscribed.is_set()

    def _subscription_error(self) -> LinkError:
        return LinkError(
            f"the broker at {self.opts.host}:{self.opts.port} "
            + (
                f"refused {self.client_id!r}'s subscriptions {self.subscriptions}: {self._sub_refused}"
                if self._sub_refused is not None
                else f"did not confirm {self.client_id!r}'s subscriptions within "
                f"{self.opts.connect_timeout_s:.0f} s"
            )
        )

    def _reset_session(self, stop: threading.Event | None) -> None:
        done = threading.Event()
        failure: list[str] = []
        c = self._new_client(False)

        def on_connect(
            client: mqtt.Client,
            userdata: object,
            flags: mqtt.ConnectFlags,
            rc: mqtt.ReasonCode,
            props: Properties | None,
        ) -> None:
            if rc.is_failure:
                failure.append(str(rc))
            done.set()

        c.on_connect = on_connect
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0
        deadline = time.monotonic() + self.opts.connect_timeout_s
        while True:
            try:
                c.connect(
                    self.opts.host, self.opts.port, self.opts.keepalive_s, clean_start=True, properties=props
                )
                break
            except ssl.SSLCertVerificationError as exc:
                raise LinkError(self._tls_message(exc)) from None
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise LinkError(
                        f"cannot reach the broker at {self.opts.host}:{self.opts.port}: {exc}"
                    ) from None
                time.sleep(self.opts.reconnect_min_s)
        c.loop_start()
        ok = done.wait(0.1)
        while not ok and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            ok = done.wait(0.1)
        c.disconnect()
        c.loop_stop()
        if stop is not None and stop.is_set() and not ok:
            raise LinkError(f"stopped while waiting for the broker at {self.opts.host}:{self.opts.port}")
        if not ok:
            raise LinkError(
                self._tls_problem() or f"no answer from the broker at {self.opts.host}:{self.opts.port}"
            )
        if failure:
            raise LinkError(
                f"the broker at {self.opts.host}:{self.opts.port} refused {self.client_id!r}: {failure[0]}"
            )

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect cleanly (so no will is sent), after waiting up to ``timeout`` s for the broker
        to acknowledge what was published (QoS 1 acks come in order, so the last one suffices) and
        for a read pass being handed over to queue its acknowledgements: the owner may already hold
        its messages (and be closing because of them), and unacknowledged they would be delivered
        again on the next connection. The acks go out ahead of the DISCONNECT (one queue)."""
        last = self._last_publish
        on_loop = threading.current_thread() is self._client._thread  # a sink closing: its own pass
        deadline = time.monotonic() + timeout
        while (
            ((last is not None and not _published(last)) or (self._handing_over and not on_loop))
            and self._client.is_connected()
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        # The acks just queued must reach the socket before the DISCONNECT ends the thread's loop
        # (a sink closing is that thread: its writes wait until it returns).
        while (
            not on_loop
            and self._client._out_packet
            and self._client.is_connected()
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        self._client.disconnect()
        # paho's loop_stop joins the network thread without a limit; a thread blocked in its owner's
        # sink (a full inbox not yet closed) would hold the process forever. Bounded here: the
        # thread is a daemon, and a stuck one is left behind with a warning.
        thread = self._client._thread
        self._client._thread_terminate = True
        if thread is not None and not on_loop:
            thread.join(max(1.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning(
                    "%s: the network thread did not stop within %.0f s; left behind", self.client_id, timeout
                )

    def _tls_message(self, exc: ssl.SSLCertVerificationError) -> str:
        return (
            f"TLS: the broker at {self.opts.host}:{self.opts.port} presented a certificate that does not verify: "
            f"{exc.verify_message or exc}. The certificate's CN / subjectAltName must name the host given "
            f"in --broker ({self.opts.host!r}), and --tls-ca must hold the CA that signed it"
        )

    def _tls_problem(self) -> str | None:
        """When a TLS connection got no answer, say why if the handshake is the reason (paho's
        network thread retries silently): a certificate that does not match the host, an unknown CA."""
        o = self.opts
        if o.tls_ca is None:
            return None
        try:
            ctx = ssl.create_default_context(cafile=o.tls_ca)
            if o.tls_cert is not None:
                ctx.load_cert_chain(o.tls_cert, o.tls_key)
            with (
                socket.create_connection((o.host, o.port), timeout=5.0) as sock,
                ctx.wrap_socket(sock, server_hostname=o.host),
            ):
                return None
        except ssl.SSLCertVerificationError as exc:
            return self._tls_message(exc)
        except ssl.SSLError as exc:
            return f"TLS handshake with the broker at {o.host}:{o.port} failed: {exc}"
        except OSError:
            return None

    # ------------------------------------------------------------------ traffic
    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        info = self._client.publish(topic, payload, qos=1, retain=retain)
        self._last_publish = info
        if info.rc not in (
            mqtt.MQTT_ERR_SUCCESS,
            mqtt.MQTT_ERR_NO_CONN,
        ):  # NO_CONN: queued, sent on reconnect
            raise LinkError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")

    def ack(self, mid: int, qos: int, epoch: int) -> None:
        self.ack_many([(mid, qos, epoch)])

    def ack_many(self, items: list[tuple[int, int, int]]) -> None:
        """Acknowledge ``(mid, qos, epoch)`` messages (``manual_ack``): one write for all of them.
        Acks of an older connection are dropped (the broker redelivers those messages)."""
        if self.manual_ack:
            self._send_acks([mid for mid, qos, epoch in items if qos > 0 and epoch == self.epoch])

    def _send_acks(self, mids: list[int]) -> None:
        """The PUBACKs of ``mids``, queued as one packet (paho writes and wakes its thread once)."""
        if mids and self._client.is_connected():
            data = b"".join(_PUBACK.pack(0x40, 2, mid) for mid in mids)
            self._client._packet_queue(0x40, data, 0, 0)

    @property
    def connected(self) -> bool:
        return self._client.is_connected()

    # ------------------------------------------------------------------ paho callbacks (network thread)
    def _on_connect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.ConnectFlags,
        rc: mqtt.ReasonCode,
        props: Properties | None,
    ) -> None:
        if rc.is_failure:
            log.warning("%s: broker refused the connection: %s", self.client_id, rc)
            if not self._first.is_set():
                self._refused = str(rc)
                self._first.set()
            return
        # What the last connection delivered comes before the notice, unacknowledged: its packet
        # ids meant nothing to this connection (the broker redelivers those messages).
        self._rx_acks = []
        self._flush()
        self.epoch += 1
        self._arm_will(self.epoch + 1)
        if self.subscriptions:
            _, mid = client.subscribe([(t, mqtt.SubscribeOptions(qos=1)) for t in self.subscriptions])
            if not self._subscribed.is_set():
                self._sub_mid = mid
        else:
            self._subscribed.set()
        self.sink(Connected(self.epoch, bool(flags.session_present)))
        self._first.set()
        if self.epoch > 1:
            log.info("%s: reconnected (session present: %s)", self.client_id, flags.session_present)

    def _on_subscribe(
        self,
        client: mqtt.Client,
        userdata: object,
        mid: int,
        reason_codes: list[mqtt.ReasonCode],
        props: Properties | None,
    ) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        if refused:
            log.warning(
                "%s: broker refused subscriptions %s: %s", self.client_id, self.subscriptions, refused
            )
        if mid == self._sub_mid and not self._subscribed.is_set():
            self._sub_refused = ", ".join(refused) if refused else None
            self._subscribed.set()

    def _on_disconnect(
        self,
        client: mqtt.Client,
        userdata: object,
        flags: mqtt.DisconnectFlags,
        rc: mqtt.ReasonCode,
        props: Properties | None,
    ) -> None:
        if rc.is_failure:
            log.info("%s: disconnected (%s); paho reconnects", self.client_id, rc)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        """paho's path (a message the fast path leaves to paho): into the same read pass."""
        self._received(msg.topic, bytes(msg.payload), msg.mid, msg.qos, bool(msg.dup))

    def _received(self, topic: str, payload: bytes, mid: int, qos: int, dup: bool) -> None:
        self._rx.append(Inbound(topic, payload, mid, qos, dup, self.epoch, time.monotonic()))
        if qos > 0:  # 1: a link subscribes at QoS 1, so the broker delivers nothing at QoS 2
            self._rx_acks.append(mid)
        self._rx_bytes += len(payload)
        if self._rx_bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Hand the read pass's messages to the owner (one ``batch_sink`` call, or ``sink`` each),
        then, unless the owner acknowledges (``manual_ack``), acknowledge them: only what the owner
        took, so a message dropped by a closing owner is redelivered."""
        if not self._rx:
            return
        rx, acks = self._rx, self._rx_acks
        self._rx, self._rx_acks, self._rx_bytes = [], [], 0
        self._handing_over = True
        try:
            with keeping_alive(self._upkeep):
                if self.batch_sink is not None:
                    taken = self.batch_sink(rx)
                else:
                    for item in rx:
                        self.sink(item)
                    taken = True
            if taken and not self.manual_ack:
                self._send_acks(acks)
        finally:
            self._handing_over = False

    def _upkeep(self) -> None:
        """The network thread waits for room in its owner's inbox: write what is queued (the
        owner's acknowledgements) and a PINGREQ every half keep-alive, reading nothing. Unread
        bytes in the socket show the broker alive, so paho's own keep-alive does not give up on it.

        Why half: the broker drops a connection silent for 1.5 keep-alives, counted in whole
        seconds, and a server whose inbox is full is a loaded one whose thread may run late; a
        PINGREQ at each full keep-alive (paho's own rule) leaves too little of that margin."""
        c = self._client
        sock = c._sock
        if sock is None:
            return
        now = mqtt.time_func()
        with c._msgtime_mutex:
            if _unread(sock):
                c._last_bytes_received = now
            ping = c._keepalive > 0 and now - c._last_msg_out >= c._keepalive / 2
        if ping and c._send_pingreq() == mqtt.MQTT_ERR_SUCCESS:
            with c._msgtime_mutex:
                c._last_msg_out = now
        c._check_keepalive()  # and paho's own check: a broker silent for a keep-alive is gone
        c.loop_write()
        self.upkeeps += 1


def _unread(sock: Any) -> bool:
    """Whether bytes (or the end of the stream) wait to be read on ``sock``."""
    try:
        pending = getattr(sock, "pending", None)
        if pending is not None and pending():
            return True
        return bool(select.select([sock], [], [], 0.0)[0])
    except (OSError, ValueError):
        return False
