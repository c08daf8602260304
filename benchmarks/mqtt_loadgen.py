"""A light MQTT load generator for the capacity benchmark: thousands of clients in one process.

``felix emulate`` runs one paho client (and its network thread) per emulated device, 250 per
process: 1,000 clients already take ~130% of a core, so on one machine the emulated clients, not
the server, were the bottleneck. This process opens N authenticated connections on one asyncio
loop and speaks only the MQTT 3.1.1 subset a capacity run needs: CONNECT/CONNACK (username =
client id = ``client-<k>``, the generated password, as the broker config demands), SUBSCRIBE to
the client's task topic when it answers tasks (and, on the first connection, to the server's
retained status), PUBLISH at QoS 1 with PUBACK handling both ways, and PINGREQ within the keep
alive. The messages are genuine: REGISTER (the client's real sample and class counts, from the
config's partition), STATE and RESULT built with ``felix.deploy.wire`` on ``felix.deploy.topics``,
so the server validates them exactly as it does real clients' messages.

Why hand-rolled rather than a library: paho (and aiomqtt, which wraps it) costs a thread or a
task set and MQTT 5 property handling per client; gmqtt keeps several tasks and timers per
client. Here a connection is one ``asyncio.Protocol`` (a few hundred bytes of state), one timer
task drives every client's tier changes and one the keep-alives, so 10,000 clients and 5,000
messages per second cost a fraction of a core. It is benchmark code: no TLS, no reconnects,
no last will (MQTT 3.1.1 has no will delay); a lost connection is counted, reported and opened again.

Behaviour:
- every client registers once the server's retained status says ``running`` (as real clients do);
- tier changes: ``--rate`` STATE messages per second in total, each from a random client moving
  to one of the two other tiers (AVL_TRAIN, AVL_EVAL, UN_AVL);
- ``--answer``: clients subscribe to their task topic and answer each TRAIN / EVAL task
  ``--answer-delay`` s after it arrives with a zero update of the model's size (as ``felix emulate
  --no-train``); CANCEL is ignored.

It prints one JSON line per second (cumulative counters) and a last one when it stops (SIGTERM,
SIGINT or ``--duration``). Run by ``benchmarks/mqtt_capacity.py --loadgen light``; by hand::

    python benchmarks/mqtt_loadgen.py CONFIG --broker 127.0.0.1:1883 --credentials creds.json \
        --run-id cap --clients 10000 --rate 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import selectors
import signal
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.shards import shard_of
from felix.deploy.topics import Topics, client_user

TIERS = (Tier.AVL_TRAIN, Tier.AVL_EVAL, Tier.UN_AVL)
KEEPALIVE_S = 60

# ---------------------------------------------------------------------- MQTT 3.1.1 packets


def _varint(n: int) -> bytes:
    """MQTT's remaining-length encoding (7 bits per byte, high bit = more)."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def connect_packet(client_id: str, username: str, password: str, keepalive: int) -> bytes:
    """CONNECT, MQTT 3.1.1, clean session, with username and password."""
    body = _str("MQTT") + bytes([4, 0x80 | 0x40 | 0x02]) + struct.pack("!H", keepalive)
    body += _str(client_id) + _str(username) + _str(password)
    return b"\x10" + _varint(len(body)) + body


def publish_packet(topic: bytes, payload: bytes, pid: int) -> bytes:
    """PUBLISH at QoS 1 (flags 0x2), not retained."""
    body = _str(topic) + struct.pack("!H", pid)
    return b"\x32" + _varint(len(body) + len(payload)) + body + payload


def subscribe_packet(pid: int, topics: list[str]) -> bytes:
    body = struct.pack("!H", pid) + b"".join(_str(t) + b"\x01" for t in topics)
    return b"\x82" + _varint(len(body)) + body


PINGREQ = b"\xc0\x00"
DISCONNECT = b"\xe0\x00"


def puback_packet(pid: int) -> bytes:
    return b"\x40\x02" + struct.pack("!H", pid)


def split_packets(buf: bytearray) -> list[tuple[int, bytes]]:
    """Remove every complete packet from ``buf``: ``[(first byte, body)]``."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    n = len(buf)
    while pos + 2 <= n:
        mult, length, i = 1, 0, pos + 1
        while True:
            if i >= n:
                del buf[:pos]
                return out
            b = buf[i]
            length += (b & 0x7F) * mult
            mult *= 128
            i += 1
            if not b & 0x80:
                break
            if mult > 128**3:
                raise ValueError("malformed remaining length")
        if i + length > n:
            break
        out.append((buf[pos], bytes(buf[i : i + length])))
        pos = i + length
    del buf[:pos]
    return out


def parse_publish(first: int, body: bytes) -> tuple[str, int | None, bytes]:
    """(topic, packet id or None at QoS 0, payload) of a PUBLISH body."""
    (tlen,) = struct.unpack_from("!H", body)
    topic = body[2 : 2 + tlen].decode()
    pos = 2 + tlen
    pid = None
    if (first >> 1) & 0x03:
        (pid,) = struct.unpack_from("!H", body, pos)
        pos += 2
    return topic, pid, body[pos:]


def state_payload(run_id: str, msg_id: str, sent_at: float, cid: int, incarnation: str, tier: Tier) -> bytes:
    """``wire.encode`` of a STATE message, byte for byte (``tests/test_mqtt_loadgen.py`` checks it),
    from a template: thousands per second through the dataclass and ``json.dumps`` cost the load
    generator a fifth of a core that the broker and the server under test, on the same machine,
    are short of. ``run_id`` and ``incarnation`` need no JSON escaping (run ids are checked;
    incarnations are hex)."""
    header = (
        f'{{"fmt":{wire.FORMAT_VERSION},"type":"state","run":"{run_id}","msg":"{msg_id}","sent":{sent_at!r},'
        f'"payload":0,"arrays":[],"client":{cid},"incarnation":"{incarnation}","tier":"{tier.name}"}}'
    ).encode()
    return _WIRE_PREFIX.pack(wire.MAGIC, wire.FORMAT_VERSION, len(header)) + header


_WIRE_PREFIX = struct.Struct("<4sHI")


# ---------------------------------------------------------------------- one connection


@dataclass
class Counters:
    connected: int = 0
    refused: int = 0
    lost: int = 0
    reopened: int = 0  # lost connections opened again (and registered again once running)
    registered: int = 0
    sent_state: int = 0
    sent_result: int = 0
    acked: int = 0  # PUBACKs from the broker for our publishes
    tasks_in: int = 0
    pings: int = 0


class Conn(asyncio.Protocol):
    """One client's connection: writes whole packets, reads CONNACK, SUBACK, PUBACK, PINGRESP and
    the server's task / status PUBLISHes (acknowledged at once, handed to ``on_publish``)."""

    def __init__(self, gen: LoadGen, cid: int) -> None:
        self.gen = gen
        self.cid = cid
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.connack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.next_pid = 0
        self.last_write = 0.0

    def pid(self) -> int:
        self.next_pid = self.next_pid % 65535 + 1
        return self.next_pid

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():  # lost (counted): asyncio would log every write to it
            return
        self.transport.write(data)
        self.last_write = time.monotonic()

    def publish(self, topic: bytes, payload: bytes) -> None:
        self.write(publish_packet(topic, payload, self.pid()))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.connack.done():
            self.connack.set_exception(
                ConnectionError(f"client {self.cid}: connection closed before CONNACK")
            )
        elif not self.gen.stopping:
            self.gen.counters.lost += 1
            self.gen.reopen(self.cid)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        for first, body in split_packets(self.buf):
            kind = first >> 4
            if kind == 4:  # PUBACK
                self.gen.counters.acked += 1
            elif kind == 3:  # PUBLISH
                topic, pid, payload = parse_publish(first, body)
                if pid is not None:
                    self.write(puback_packet(pid))
                self.gen.on_publish(self, topic, payload)
            elif kind == 2 and not self.connack.done():  # CONNACK: flags, return code
                self.connack.set_result(body[1])


# ---------------------------------------------------------------------- the event loop


class CoalescingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """asyncio's selector, but returning at most once per ``tick_s``: a wait that would end sooner
    sleeps out the rest of the tick first, so everything that arrived meanwhile is handled in one
    pass, and the STATE messages due in a tick leave together (``LoadGen.drive_tiers``).

    Why: these processes stand in for devices on other machines, but here they share two cores
    with the brokers and the server under test, and every wake-up of a sleeping process (a PUBACK
    waking a load generator, a message waking a broker) costs kernel time on those cores. Over six
    load generators and six brokers at 8,000 messages/s, 5 ms ticks left the machine 18% idle and
    20 ms ticks 30-33% (``docs/deployment.md``). Bursts do not flatter the delay measured: a
    message's timestamp is taken as it is sent, and a burst can only queue longer at the server.
    What waits up to a tick is the load generator's own reactions (PUBACK counts, task answers)."""

    def __init__(self, tick_s: float) -> None:
        super().__init__()
        self.tick_s = tick_s
        self.last = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout > 0:
            nap = self.last + self.tick_s - time.monotonic()
            if nap > 0:
                if timeout is not None:
                    nap = min(nap, timeout)
                    timeout -= nap
                time.sleep(nap)
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        self.last = time.monotonic()
        return ready


# ---------------------------------------------------------------------- the generator


@dataclass(frozen=True)
class ClientInfo:
    num_samples: int
    class_counts: tuple[int, ...]


class LoadGen:
    def __init__(
        self,
        brokers: list[tuple[str, int]],
        run_id: str,
        passwords: dict[str, str],
        clients: list[ClientInfo],
        rate: float,
        num_params: int,
        answer: bool = False,
        answer_delay_s: float = 0.01,
        seed: int = 0,
        max_connecting: int = 64,
        first_id: int = 0,
        tick_s: float = 0.02,
    ) -> None:
        self.brokers = brokers  # one per shard: client k connects to brokers[shard_of(k, len(brokers))]
        self.tick_s = tick_s  # see CoalescingSelector
        self.first = first_id  # clients first_id .. first_id + len(clients) - 1; arrays are by k - first_id
        self.topics = Topics(run_id)
        self.run_id = run_id
        self.passwords = passwords
        self.clients = clients
        self.rate = rate
        self.answer = answer
        self.answer_delay_s = answer_delay_s
        self.rng = np.random.default_rng(seed)
        n = len(clients)
        self.tiers = self.rng.integers(0, len(TIERS), n)
        self.incarnation = [secrets.token_hex(4) for _ in range(n)]
        self.seq = [0] * n
        self.state_topic = [self.topics.state(first_id + i).encode() for i in range(n)]
        self.result_topic = [self.topics.result(first_id + i).encode() for i in range(n)]
        self.zero_delta = np.zeros(num_params, np.float32)
        self.conns: list[Conn | None] = [None] * n  # by client (k - first_id): its current connection
        self.opened: list[Conn] = []  # in the order they opened
        self.sem = asyncio.Semaphore(max_connecting)
        self._reopening: set[asyncio.Task[None]] = set()
        self.counters = Counters()
        self.session: str | None = None
        self.running = asyncio.Event()
        self.stopping = False
        self.started = time.monotonic()

    # ------------------------------------------------------------------ messages
    def env(self, cid: int) -> dict[str, Any]:
        i = cid - self.first
        self.seq[i] += 1
        return {
            "run": self.run_id,
            "msg_id": f"{self.incarnation[i]}-{self.seq[i]}",
            "sent_at": time.time(),
        }

    def register(self, conn: Conn) -> None:
        cid, i = conn.cid, conn.cid - self.first
        info = self.clients[i]
        msg = wire.Register(
            **self.env(cid),
            client=cid,
            incarnation=self.incarnation[i],
            num_samples=info.num_samples,
            tier=TIERS[self.tiers[i]],
            class_counts=info.class_counts,
        )
        conn.publish(self.topics.register(cid).encode(), wire.encode(msg))
        self.counters.registered += 1

    def send_state(self, i: int, step: int) -> None:
        """A STATE message from this process's ``i``-th client to one of its two other tiers
        (``step`` 1 or 2 tiers on)."""
        cid = self.first + i
        t = (self.tiers[i] + step) % len(TIERS)
        self.tiers[i] = t
        env = self.env(cid)
        payload = state_payload(
            self.run_id, env["msg_id"], env["sent_at"], cid, self.incarnation[i], TIERS[t]
        )
        conn = self.conns[i]
        if conn is not None:
            conn.publish(self.state_topic[i], payload)
        self.counters.sent_state += 1

    def on_publish(self, conn: Conn, topic: str, payload: bytes) -> None:
        try:
            msg = wire.decode(payload)
        except wire.MessageError:
            return
        if isinstance(msg, wire.Status):
            if msg.state == "running" and msg.session != self.session:
                self.session = msg.session
                self.running.set()
            return
        if isinstance(msg, (wire.TrainTask, wire.EvalTask)) and msg.client == conn.cid:
            self.counters.tasks_in += 1
            loop = asyncio.get_running_loop()
            loop.call_later(self.answer_delay_s, self.send_result, conn, msg.task, msg.version, msg.TYPE)

    def send_result(self, conn: Conn, task: int, version: int, mtype: wire.MsgType) -> None:
        if self.stopping or conn.transport is None or conn.transport.is_closing():
            return
        cid, i = conn.cid, conn.cid - self.first
        train = mtype is wire.MsgType.TRAIN
        msg = wire.Result(
            **self.env(cid),
            client=cid,
            incarnation=self.incarnation[i],
            task=task,
            kind=TaskKind.TRAIN if train else TaskKind.EVAL,
            version=version,
            update=ClientUpdate(
                num_samples=self.clients[i].num_samples,
                stat_utility=1.0,
                loss=1.0,
                duration=self.answer_delay_s,
                delta=self.zero_delta if train else None,
            ),
        )
        conn.publish(self.result_topic[i], wire.encode(msg))
        self.counters.sent_result += 1

    # ------------------------------------------------------------------ connections
    def reopen(self, cid: int) -> None:
        """A lost connection (a broker that dropped it) opens again a second later; once the run
        is on, the client registers again (same incarnation: the server refreshes it)."""
        task = asyncio.get_running_loop().create_task(self._reopen(cid))
        self._reopening.add(task)
        task.add_done_callback(self._reopening.discard)

    async def _reopen(self, cid: int) -> None:
        while not self.stopping:  # a busy broker may not answer in time: try again
            await asyncio.sleep(1.0)
            try:
                conn = await self.open(cid)
            except (OSError, TimeoutError):  # ConnectionError is an OSError
                continue
            self.counters.reopened += 1
            if self.running.is_set():
                self.register(conn)
            return

    async def open(self, cid: int) -> Conn:
        loop = asyncio.get_running_loop()
        user = client_user(cid)
        host, port = self.brokers[shard_of(cid, len(self.brokers))]
        async with self.sem:
            _, conn = await loop.create_connection(lambda: Conn(self, cid), host, port)
            conn.write(connect_packet(user, user, self.passwords[user], KEEPALIVE_S))
            rc = await asyncio.wait_for(conn.connack, 30)
        if rc != 0:
            self.counters.refused += 1
            raise ConnectionError(f"broker refused {user}: CONNACK return code {rc}")
        self.counters.connected += 1
        self.opened.append(conn)
        self.conns[cid - self.first] = conn
        subs = [self.topics.task(cid)] if self.answer else []
        if cid == self.first:
            subs.append(self.topics.status)
        if subs:
            conn.write(subscribe_packet(conn.pid(), subs))
        return conn

    async def keepalive(self) -> None:
        """PINGREQ for every connection idle for half the keep-alive, checked once a second."""
        while True:
            await asyncio.sleep(1.0)
            limit = time.monotonic() - KEEPALIVE_S / 2
            for c in self.opened:
                if c.last_write < limit and c.transport is not None and not c.transport.is_closing():
                    c.write(PINGREQ)
                    self.counters.pings += 1

    async def drive_tiers(self) -> None:
        """``rate`` STATE messages per second in total, from random clients, each tick's together."""
        if self.rate <= 0:
            return
        n = len(self.conns)
        t0, sent = time.monotonic(), 0
        while True:
            await asyncio.sleep(self.tick_s)
            due = int(self.rate * (time.monotonic() - t0)) - sent
            if due <= 0:
                continue
            for i, step in zip(
                self.rng.integers(0, n, due).tolist(),
                self.rng.integers(1, len(TIERS), due).tolist(),
                strict=True,
            ):
                self.send_state(i, step)
            sent += due

    async def report(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.print_line()

    def print_line(self) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        line = {"t": round(time.monotonic(), 3), **asdict(self.counters), "cpu_s": r.ru_utime + r.ru_stime}
        print(json.dumps(line), flush=True)

    async def run(self, duration_s: float) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        t0 = time.monotonic()
        reporter = asyncio.create_task(self.report())
        # Keep-alives from the first connection on: opening 20,000 connections on a busy machine
        # takes longer than the broker waits (1.5 keep-alives) for a word from the first ones.
        pinger = asyncio.create_task(self.keepalive())
        ids = range(self.first, self.first + len(self.clients))
        await asyncio.gather(*(self.open(c) for c in ids))
        print(json.dumps({"connected_s": round(time.monotonic() - t0, 2)}), flush=True)
        await self.running.wait()
        for conn in self.conns:
            if conn is not None:
                self.register(conn)
        driver = asyncio.create_task(self.drive_tiers())
        try:
            await asyncio.wait_for(stop.wait(), duration_s)
        except TimeoutError:
            pass
        self.stopping = True
        for task in (driver, pinger, reporter):
            task.cancel()
        c = self.counters
        for _ in range(100):  # the broker's last PUBACKs
            if c.acked >= c.registered + c.sent_state + c.sent_result:
                break
            await asyncio.sleep(0.05)
        self.print_line()
        for conn in self.conns:
            if conn is not None and conn.transport is not None:
                conn.transport.write(DISCONNECT)
                conn.transport.close()
        await asyncio.sleep(0.1)


def client_infos(cfg_path: str, n: int) -> tuple[list[ClientInfo], int]:
    """Clients 0..n-1's sample and class counts as ``felix client`` derives them, and the model size."""
    from felix.engine.setup import resolve_config
    from felix.scenario.build import build_population

    cfg = resolve_config(cfg_path, None, {})
    pop = build_population(cfg)
    if len(pop.client_data) < n:
        raise SystemExit(f"the config's partition has {len(pop.client_data)} clients, fewer than {n}")
    c = pop.train.num_classes
    infos = [
        ClientInfo(len(d), tuple(int(x) for x in np.bincount(d.y.numpy(), minlength=c)))
        for d in pop.client_data[:n]
    ]
    return infos, int(pop.initial_weights.size)


def save_infos(path: str, infos: list[ClientInfo], num_params: int) -> None:
    """The population's counts for load generators started side by side (``--infos``): building
    a 100,000-client population once instead of once per process."""
    np.savez(
        path,
        samples=np.array([i.num_samples for i in infos], np.int64),
        classes=np.array([i.class_counts for i in infos], np.int64),
        num_params=np.int64(num_params),
    )


def load_infos(path: str, first: int, n: int) -> tuple[list[ClientInfo], int]:
    with np.load(path) as f:
        samples, classes = f["samples"][first : first + n], f["classes"][first : first + n]
        if len(samples) < n:
            raise SystemExit(f"{path} holds {len(f['samples'])} clients, fewer than {first + n}")
        infos = [ClientInfo(int(s), tuple(int(x) for x in c)) for s, c in zip(samples, classes, strict=True)]
        return infos, int(f["num_params"])


def raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY not in (soft, hard) and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the run's config file (partition: sample and class counts)")
    p.add_argument("--broker", required=True, help="HOST:PORT, or one per shard, comma-separated")
    p.add_argument("--credentials", required=True, help="credentials.json of felix mqtt-credentials")
    p.add_argument("--run-id", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--first-id", type=int, default=0, help="id of the first client (default 0)")
    p.add_argument("--infos", help="the population's counts from save_infos (default: built from the config)")
    p.add_argument("--rate", type=float, default=0.0, help="STATE messages per second, all clients together")
    p.add_argument("--answer", action="store_true", help="subscribe to tasks and answer them")
    p.add_argument("--answer-delay", type=float, default=0.01)
    p.add_argument("--duration", type=float, default=3600.0, help="stop after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tick-ms",
        type=float,
        default=20.0,
        help="each tick's STATE messages leave together, and the event loop wakes at most once "
        "per tick (CoalescingSelector)",
    )
    args = p.parse_args(argv)
    if not 0 < args.tick_ms <= 1000:
        raise SystemExit(f"--tick-ms must be in (0, 1000], not {args.tick_ms}")
    brokers = [(h, int(port)) for h, _, port in (a.rpartition(":") for a in args.broker.split(","))]
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raise_open_file_limit()
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < args.clients + 64:
        print(f"open-file limit {limit} is too low for {args.clients} connections", file=sys.stderr)
        return 2
    with open(args.credentials) as f:
        passwords = json.load(f)
    if args.infos:
        infos, num_params = load_infos(args.infos, args.first_id, args.clients)
    else:
        infos, num_params = client_infos(args.config, args.first_id + args.clients)
        infos = infos[args.first_id :]
    gen = LoadGen(
        brokers,
        args.run_id,
        passwords,
        infos,
        args.rate,
        num_params,
        args.answer,
        args.answer_delay,
        args.seed,
        first_id=args.first_id,
        tick_s=args.tick_ms / 1000,
    )
    with asyncio.Runner(
        loop_factory=lambda: asyncio.SelectorEventLoop(CoalescingSelector(args.tick_ms / 1000))
    ) as runner:
        runner.run(gen.run(args.duration))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
