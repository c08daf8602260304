"""Soak benchmark of the MQTT deployment: churn, crashes and hostile input together, on loopback.

A Mosquitto broker on 127.0.0.1, ``felix serve --checkpoint`` in its own process, and emulated
clients (``felix client --ids``, in groups of processes) under a slotted churn trace, while the
schedule below runs; then the server is stopped (SIGTERM) and the outcome is printed as one JSON
line. Every wait is bounded; the whole run stops by itself after ``--duration`` seconds plus the
shutdown.

Schedule, spread evenly over the run:
- client groups are killed with SIGKILL mid-task (their tasks die with them) and restarted,
  until ``--client-kills`` clients have been killed;
- the broker is killed with SIGKILL (nothing saved since its last autosave) and restarted,
  ``--broker-kills`` times;
- the server is killed with SIGKILL and resumed from its checkpoint, ``--server-kills`` times;
- a hostile client (a valid login of its own) sends ``--fuzz`` fuzzed messages: random
  mutations (bytes flipped, truncated or appended, header fields replaced, messages on the wrong
  topic, verbatim and altered replays) of the genuine REGISTER, STATE and RESULT messages it
  sends, on every topic it may publish to; and it answers the tasks it receives with poisoning
  attempts (finite but huge deltas, 2**40 samples, a new aux entry with a different shape each
  time) or with honest zero updates;
- before that schedule, two windows of ``attack_s`` wall seconds with no kills and no fuzzing:
  a quiet one, then one under attack, where a flapping client (a valid login) flips its tier
  between AVL_TRAIN and UN_AVL ``flap_per_s`` times a second and a flooding client publishes
  tier flips at ``flood_per_s``; the honest aggregation rate is measured in both. An
  aux-poisoning client (a valid login) answers every training task it gets, all run long, with a
  zero update whose SCAFFOLD ``sum:scaffold_dc`` entry has the declared key, shape and dtype but
  the value 1e30 (the soak runs SCAFFOLD so that such an entry is declared). Two more attackers
  join the attack window: a slow flipper (26 tier changes per config minute, under the flap
  limit) and a heavy-header sender (64 KiB headers of 32,000 integers, ``heavy_per_s`` a second);
  and all run long two logins answer every task with ``stat_utility`` 1.7e308 (outside its
  declared range) and 1e36 (its top);
- before the first resume of the server, while it is down, the heavy-header sender publishes 70
  messages of 1 MB on its own result topic (the backlog the resumed session finds).

The JSON line:
- ``acked_lost``: training updates the server applied and made durable (covered by a checkpoint,
  hence acknowledged to the broker) in a life that was later killed, missing from the final
  applied-update log;
- ``applied_twice``: task ids applied more than once in the final log;
- ``server_crashes``: server lives that ended without being killed or stopped by the soak
  (the soak resumes it and goes on);
- ``bad_updates_applied``: poisoning attempts that were applied (in the final log);
- ``poisoning_attempts``: poisoned answers the hostile client sent (one per training task it got;
  a zero here means the soak tested no poisoning);
- ``rss_start_mb`` / ``rss_end_mb``: the server process's RSS once its first life is warm (its
  first checkpoint written) and just before the final stop (the last life);
- ``tier_msgs_per_s`` / ``round_trips_per_s``: tier reports and task results the server handled
  per wall second (from its summary, all lives);
- ``aux_poisoning_attempts``: 1e30 aux answers the aux-poisoning client sent (they count in
  ``bad_updates_applied`` if applied);
- ``attack_msgs_per_s``: tier messages the two attackers published per wall second (what this
  Python publisher reached, which may fall short of the plan's rates on a busy machine);
- ``attack_bytes_up`` / ``attack_bytes_down``: payload bytes the flapping and flooding clients
  published, and received on their task topics (tasks and cancels), while attacking;
  ``amplification`` is their ratio, and ``amplification_bound`` what admission control allows:
  each attacker is sent at most one task per change to an available tier it gets through (a task
  holds its slot until a flip away frees it) and at most one cancel per task, and it is damped
  after ``flap_limit`` changes in ``flap_window_s``, while its task budget caps the same count at
  ``2 (task_burst + task_rate T) + 2`` over T config seconds: the smaller of the two, times the
  largest task message, over the bytes it sent;
- ``versions_per_s_quiet`` / ``versions_per_s_attack``: new model versions per wall second in the
  quiet window and under attack, and ``throughput_ratio`` the second over the first;
- ``rate_limited`` / ``damped``: messages the server refused at intake for the sender's message
  budget, and clients it damped for flapping (the last life's summary); ``cost_limited``: those
  refused for the sender's cost budget (decode time or bytes per wall second);
- ``slow_flips`` / ``slow_flipper_amplification`` / ``slow_flipper_messages_down``: the slow
  flipper's flips in the attack window, the bytes it was sent over those it sent, and the tasks
  and cancels it was sent (the drop budget bounds their number: ``2 + T / 600`` unanswered
  downloads over T config seconds, and one cancel each; the download budget their bytes: at most
  what it sent, plus one task, plus its largest task per 600 wall seconds); with ``--model-http`` the bytes down are the task
  messages and the models the attackers fetched over HTTP (each keeps the last one it fetched,
  as a client does: a task on the model it holds costs no download), and
  ``slow_flipper_http_bytes_down`` the latter (``slow_flipper_broker_amplification``: the
  task messages alone over the bytes it sent); ``heavy_headers_sent``: the heavy headers
  published; ``extreme_utility_answers``: training tasks answered with 1.7e308 and with 1e36 (the
  first count in ``bad_updates_applied`` if applied); ``resume_after_backlog_s``: wall seconds
  from starting the resumed server over the backlog to its "serving" line.

``--quick`` is a few minutes (fewer kills, 1,000 fuzzed messages); ``--tiny`` is the test suite's
version. Run: ``python benchmarks/soak.py [--quick]``.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import yaml

from felix.config import AdmissionConfig
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import checkpoint as ckpt
from felix.deploy import wire
from felix.deploy.model_fetch import FetchError, fetch_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test broker fixture
from broker import MosquittoBroker, find_mosquitto

from felix.deploy.topics import SERVER_USER, Topics, client_user

RUN = "soak"


@dataclass(frozen=True)
class Plan:
    clients: int
    groups: int
    client_kills: int
    broker_kills: int
    server_kills: int
    fuzz: int
    duration_s: float
    scale: float = 0.05  # wall seconds per config second
    attack_s: float = 10.0  # wall seconds of each measurement window (quiet, then under attack)
    flap_per_s: float = 200.0  # the flapping client's tier changes per wall second
    flood_per_s: float = 2000.0  # the flooding client's tier messages per wall second
    heavy_per_s: float = 1000.0  # the heavy-header sender's 64 KiB headers per wall second


PLANS = {
    "full": Plan(
        clients=200,
        groups=8,
        client_kills=100,
        broker_kills=5,
        server_kills=5,
        fuzz=10_000,
        duration_s=600,
        attack_s=25.0,
        flood_per_s=5000.0,
    ),
    "quick": Plan(
        clients=60,
        groups=6,
        client_kills=20,
        broker_kills=2,
        server_kills=2,
        fuzz=1_000,
        duration_s=150,
        attack_s=25.0,
        flood_per_s=5000.0,
    ),
    "tiny": Plan(
        clients=12,
        groups=2,
        client_kills=6,
        broker_kills=1,
        server_kills=1,
        fuzz=150,
        duration_s=40,
        attack_s=10.0,
        flood_per_s=1000.0,
        heavy_per_s=200.0,
    ),
}


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def write_config(path: Path, n: int) -> None:
    doc = {
        "name": "soak",
        "strategy": "felix",
        "seed": 0,
        "model": "mlp",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": n, "alpha": 0.5},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.2, "slot_s": 60.0, "horizon_s": 3600.0},
        "runtime": {"kind": "constant", "constant_s": 20.0},
        # SCAFFOLD declares model-sized aux entries: the aux-poisoning client sends one of them.
        "client": {"lr": 0.1, "batch_size": 16, "objective": "scaffold"},
        "orchestrator": {"agg_goal": 5, "concurrency": max(2, n // 2)},
        "run": {"target_accuracy": 1.0, "target_window": 3, "max_time_s": 1e7, "eval_every": 5},
    }
    path.write_text(yaml.safe_dump(doc))


def hostile_class_counts(cfg_path: Path, ids: list[int]) -> dict[int, tuple[int, ...]]:
    """The class counts of each client's partition (what ``felix client`` registers)."""
    from felix.engine.setup import resolve_config
    from felix.scenario.build import build_population

    pop = build_population(resolve_config(str(cfg_path), None, {}))
    return {
        cid: tuple(
            int(c) for c in np.bincount(pop.client_data[cid].y.numpy(), minlength=pop.train.num_classes)
        )
        for cid in ids
    }


def with_model(msg: wire.Message, payload: bytes, held: dict[str, bytes]) -> tuple[wire.Message | None, int]:
    """A task that names its model by hash (``--model-http``), decoded with the model: fetched
    over HTTP unless ``held`` has it (a client keeps the last model it fetched). Returns the task
    (None: the model could not be had) and the bytes downloaded."""
    if not isinstance(msg, (wire.TrainTask, wire.EvalTask)) or msg.model is None:
        return msg, 0
    ref = msg.model
    body = held.get(ref.sha256)
    fetched = 0
    if body is None:
        try:
            body = fetch_model(ref, 10.0)
        except (OSError, wire.MessageError, FetchError, http.client.HTTPException):
            return None, 0  # a failed download skips the task
        held.clear()
        held[ref.sha256] = body
        fetched = len(body)
    return wire.decode(payload, model_body=body), fetched


class Hostile:
    """A raw paho client holding a valid login (client ``cid``) that registers its partition's
    real counts, reporting AVL_TRAIN, on every new server session; counts the payload bytes it
    publishes and receives on its task topic."""

    def __init__(self, port: int, password: str, cid: int, class_counts: tuple[int, ...], tag: str) -> None:
        self.topics = Topics(RUN)
        self.cid = cid
        self.tag = tag
        self.class_counts = class_counts
        self.num_samples = sum(class_counts)
        self.seq = 0
        self.session: str | None = None
        self.bytes_up = 0
        self.bytes_down = 0  # task messages, and the models fetched over HTTP for them (--model-http)
        self.http_bytes_down = 0
        self.messages_down = 0
        self.downs: list[str] = []  # what it was sent: "<type> <bytes>@<wall s>", for the log
        self.largest_down = 0
        self.models: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"felix-{RUN}-c{cid}", protocol=mqtt.MQTTv5
        )
        self.c.username_pw_set(client_user(cid), password)
        self.c.reconnect_delay_set(0.25, 2)
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe(
            [(self.topics.task(cid), 1), (self.topics.status, 1)]
        )
        self.c.on_message = self._on_message
        self.c.connect_async("127.0.0.1", port)
        self.c.loop_start()

    def env(self) -> dict[str, Any]:
        with self.lock:
            self.seq += 1
            seq = self.seq
        return {"run": RUN, "msg_id": f"{self.tag}-{seq}", "sent_at": time.time()}

    def answer(self, msg: wire.TrainTask | wire.EvalTask, update: ClientUpdate) -> None:
        """Publish ``update`` as this login's result of the task ``msg``."""
        res = wire.Result(
            **self.env(),
            client=self.cid,
            incarnation=self.tag,
            task=msg.task,
            kind=TaskKind.TRAIN if isinstance(msg, wire.TrainTask) else TaskKind.EVAL,
            version=msg.version,
            update=update,
        )
        self.publish(self.topics.result(self.cid), wire.encode(res))

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self.bytes_up += len(payload)
        self.c.publish(topic, payload, qos=qos)

    def _on_message(self, client: mqtt.Client, userdata: object, m: mqtt.MQTTMessage) -> None:
        try:
            msg = wire.decode(m.payload)
        except wire.MessageError:
            return
        if isinstance(msg, wire.Status):
            if msg.session != self.session:
                self.session = msg.session
                reg = wire.Register(
                    **self.env(),
                    client=self.cid,
                    incarnation=self.tag,
                    num_samples=self.num_samples,
                    tier=Tier.AVL_TRAIN,
                    class_counts=self.class_counts,
                )
                self.publish(self.topics.register(self.cid), wire.encode(reg))
            return
        self.bytes_down += len(m.payload)
        self.messages_down += 1
        self.downs.append(f"{msg.TYPE.value} {len(m.payload)}@{time.monotonic():.1f}")
        model = getattr(msg, "model", None)
        self.largest_down = max(self.largest_down, len(m.payload) + (0 if model is None else model.size))
        full, fetched = with_model(msg, m.payload, self.models)
        self.bytes_down += fetched
        self.http_bytes_down += fetched
        if full is not None:
            self.on_task(full)

    def on_task(self, msg: wire.Message) -> None:
        """A task or a cancel arrived (its bytes are counted)."""

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class Flapper(Hostile):
    """Flips its tier between UN_AVL and AVL_TRAIN ``per_s`` times a wall second while active
    (qos 0, as a flood goes); never answers a task."""

    def __init__(self, *args: Any, per_s: float) -> None:
        super().__init__(*args)
        self.per_s = per_s
        self.flips = 0
        self.active = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"flapper-{self.cid}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        topic = self.topics.state(self.cid)
        while not self.stop.is_set():
            if not self.active.wait(0.2):
                continue
            start, base = time.monotonic(), self.flips
            while self.active.is_set() and not self.stop.is_set():
                due = base + (time.monotonic() - start) * self.per_s
                while self.flips < due:
                    self.publish(*self.next_message(topic), qos=0)
                    self.flips += 1
                time.sleep(0.002)

    def next_message(self, topic: str) -> tuple[str, bytes]:
        """The next flip: a STATE message on ``topic`` (the client's state topic)."""
        tier = Tier.UN_AVL if self.flips % 2 == 0 else Tier.AVL_TRAIN
        msg = wire.State(**self.env(), client=self.cid, incarnation=self.tag, tier=tier)
        return topic, wire.encode(msg)

    def close(self) -> None:
        self.active.clear()
        self.stop.set()
        self.thread.join(5)
        super().close()


class HeavySender(Flapper):
    """Publishes 64 KiB headers (a registration whose class counts hold 32,000 integers) ``per_s``
    times a wall second while active: each cost the server 5-12 ms to refuse before headers were
    limited before parsing and decode time was charged per login."""

    def __init__(self, *args: Any, per_s: float) -> None:
        doc = {"fmt": wire.FORMAT_VERSION, "type": "register", "run": RUN, "msg": "h-1", "sent": 1.0}
        doc |= {"payload": 0, "arrays": [], "client": args[2], "incarnation": "h", "num_samples": 0}
        doc |= {"tier": "AVL_TRAIN", "class_counts": [0] * 32_000}
        header = json.dumps(doc, separators=(",", ":")).encode()
        self.heavy = struct.pack("<4sHI", wire.MAGIC, wire.FORMAT_VERSION, len(header)) + header
        super().__init__(*args, per_s=per_s)

    def next_message(self, topic: str) -> tuple[str, bytes]:
        return self.topics.register(self.cid), self.heavy

    def backlog(self, n: int, size: int) -> None:
        """Publish ``n`` junk messages of ``size`` bytes on its own result topic (QoS 1), waiting
        until the broker has them: the backlog a resumed server finds."""
        junk = b"FLXM" + bytes(size - 4)
        infos = [self.c.publish(self.topics.result(self.cid), junk, qos=1) for _ in range(n)]
        self.bytes_up += n * size
        for info in infos:
            info.wait_for_publish(30)


class ExtremeUtility(Hostile):
    """Answers every task it gets with a zero update reporting ``stat_utility`` = ``utility``
    (1.7e308: finite, outside the declared range; 1e36: the range's top, accepted)."""

    def __init__(self, *args: Any, utility: float) -> None:
        super().__init__(*args)
        self.utility = utility
        self.answered: set[int] = set()

    def on_task(self, msg: wire.Message) -> None:
        if not isinstance(msg, (wire.TrainTask, wire.EvalTask)):
            return
        train = isinstance(msg, wire.TrainTask)
        if train:
            self.answered.add(msg.task)
        self.answer(
            msg,
            ClientUpdate(
                num_samples=self.num_samples,
                stat_utility=self.utility,
                loss=0.5,
                duration=1.0,
                delta=np.zeros(msg.weights.size, np.float32) if train else None,
            ),
        )


class AuxPoisoner(Hostile):
    """Answers every training task with a zero update whose ``sum:scaffold_dc`` is 1e30 (the
    declared key, shape and dtype), and every eval task honestly."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.poisoned: set[int] = set()

    def on_task(self, msg: wire.Message) -> None:
        if not isinstance(msg, (wire.TrainTask, wire.EvalTask)):
            return
        train = isinstance(msg, wire.TrainTask)
        n = msg.weights.size
        aux = (
            {"scaffold_c": np.zeros(n, np.float32), "sum:scaffold_dc": np.full(n, 1e30, np.float32)}
            if train
            else {}
        )
        if train:
            self.poisoned.add(msg.task)
        self.answer(
            msg,
            ClientUpdate(
                num_samples=self.num_samples,
                stat_utility=1.0,
                loss=0.5,
                duration=1.0,
                delta=np.zeros(n, np.float32) if train else None,
                aux=aux,
            ),
        )


# ---------------------------------------------------------------------- the hostile client
class Fuzzer:
    """A raw paho client holding a valid login (client ``cid``): genuine messages as seeds, their
    mutations, and poisoned answers to the tasks it gets."""

    def __init__(
        self,
        port: int,
        password: str,
        cid: int,
        n_fuzz: int,
        duration_s: float,
        seed: int,
        class_counts: tuple[int, ...],
        poison: str = "all",
    ) -> None:
        self.topics = Topics(RUN)
        self.cid = cid
        # Its own partition's counts, as a genuine client registers them: the server refuses a
        # registration claiming more samples than the partition holds (and then sends no tasks).
        self.class_counts = class_counts
        self.num_samples = sum(class_counts)
        self.tasks_received = 0
        self.rng = random.Random(seed)
        self.poison_kinds = {"all": 4, "no-aux": 3, "none": 0}[poison]  # kinds 0..k-1 of _answer are poison
        self.n_fuzz = n_fuzz
        self.interval = duration_s / max(1, n_fuzz)
        self.sent = 0
        self.poisoned: set[int] = set()
        self.poison_attempts = 0
        self.seeds: list[bytes] = []
        self.models: dict[str, bytes] = {}
        self.seq = 0
        self.session: str | None = None
        self.stop = threading.Event()
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"felix-{RUN}-c{cid}", protocol=mqtt.MQTTv5
        )
        self.c.username_pw_set(client_user(cid), password)
        self.c.reconnect_delay_set(0.25, 2)
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe(
            [(self.topics.task(cid), 1), (self.topics.status, 1)]
        )
        self.c.on_message = self._on_message
        self.c.connect_async("127.0.0.1", port)
        self.c.loop_start()
        self.thread = threading.Thread(target=self._fuzz_loop, name="fuzzer", daemon=True)

    def _env(self) -> dict[str, Any]:
        self.seq += 1
        return {"run": RUN, "msg_id": f"fz-{self.seq}", "sent_at": time.time()}

    def _publish(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1)

    def _on_message(self, client: mqtt.Client, userdata: object, m: mqtt.MQTTMessage) -> None:
        try:
            decoded, _ = with_model(wire.decode(m.payload), m.payload, self.models)
        except wire.MessageError:
            return
        msg = decoded
        if isinstance(msg, wire.Status) and msg.session != self.session:
            self.session = msg.session
            reg = wire.encode(
                wire.Register(
                    **self._env(),
                    client=self.cid,
                    incarnation="fz",
                    num_samples=self.num_samples,
                    tier=Tier.AVL_TRAIN,
                    class_counts=self.class_counts,
                )
            )
            self.seeds.append(reg)
            self._publish(self.topics.register(self.cid), reg)
        elif isinstance(msg, wire.TrainTask):
            self.tasks_received += 1
            self._answer(msg)
        elif isinstance(msg, wire.EvalTask):
            res = wire.Result(
                **self._env(),
                client=self.cid,
                incarnation="fz",
                task=msg.task,
                kind=TaskKind.EVAL,
                version=msg.version,
                update=ClientUpdate(
                    num_samples=self.num_samples, stat_utility=1.0, loss=1.0, duration=1.0, delta=None, aux={}
                ),
            )
            self._publish(self.topics.result(self.cid), wire.encode(res))

    def _answer(self, task: wire.TrainTask) -> None:
        n = task.weights.size
        # The poison kinds in turn, then one honest answer: the first task is always poisoned.
        kind = (self.tasks_received - 1) % (self.poison_kinds + 1)
        kind = 4 if kind == self.poison_kinds else kind
        fields: dict[str, Any] = {
            "num_samples": self.num_samples,
            "delta": np.zeros(n, np.float32),
            "aux": {},
        }
        if kind == 0:
            fields["delta"] = np.full(n, 3e38, np.float32)  # finite, huge
        elif kind == 1:
            fields["num_samples"] = 2**40
            fields["delta"] = np.full(n, 1.0, np.float32)
        elif kind == 2:
            fields["delta"] = np.random.default_rng(task.task).normal(0, 1e6, n).astype(np.float32)
        elif kind == 3:
            shape = (1 + self.rng.randrange(5),)
            fields["aux"] = {"injected": np.ones(shape, np.float32)}  # a new key, another shape each time
        if kind < 4:
            self.poisoned.add(task.task)
            self.poison_attempts += 1
        res = wire.Result(
            **self._env(),
            client=self.cid,
            incarnation="fz",
            task=task.task,
            kind=TaskKind.TRAIN,
            version=task.version,
            update=ClientUpdate(stat_utility=1.0, loss=0.5, duration=1.0, **fields),
        )
        payload = wire.encode(res)
        if kind == 4:
            self.seeds.append(payload)
        self._publish(self.topics.result(self.cid), payload)

    def _mutate(self, data: bytes) -> bytes:
        r = self.rng
        op = r.randrange(7)
        b = bytearray(data)
        if op == 0 and b:  # flip bytes
            for _ in range(r.randint(1, 12)):
                b[r.randrange(len(b))] = r.randrange(256)
            return bytes(b)
        if op == 1:  # truncate
            return bytes(b[: r.randrange(max(1, len(b)))])
        if op == 2:  # append
            return bytes(b) + os.urandom(r.randint(1, 4096))
        if op in (3, 4):  # rewrite a header field
            try:
                _, version, hlen = struct.unpack_from("<4sHI", data)
                doc = json.loads(data[10 : 10 + hlen])
            except (struct.error, ValueError):
                return bytes(b)
            key = (
                r.choice(sorted(doc))
                if op == 3 or not doc
                else r.choice(["client", "task", "num_samples", "version", "msg_id", "kind", "tier"])
            )
            doc[key] = r.choice(
                [
                    -1,
                    0,
                    2**63,
                    2**40,
                    "x" * r.randint(0, 300),
                    None,
                    [1, 2],
                    1e308,
                    "NaN",
                    r.randint(0, 10**6),
                    {"$a": "a0"},
                    True,
                ]
            )
            h = json.dumps(doc).encode()
            return struct.pack("<4sHI", data[:4], version, len(h)) + h + data[10 + hlen :]
        if op == 5:  # an altered replay: same message id, other content
            return bytes(b[:-1]) + bytes([(b[-1] + 1) % 256]) if b else bytes(b)
        return bytes(b)  # a verbatim replay

    def _fuzz_loop(self) -> None:
        t = self.topics
        topics = [t.register(self.cid), t.state(self.cid), t.result(self.cid)]
        # AVL_TRAIN: a hostile client wants training tasks (an AVL_EVAL seed, delivered once
        # verbatim, parked it where it only ever got evaluations).
        state = wire.encode(wire.State(**self._env(), client=self.cid, incarnation="fz", tier=Tier.AVL_TRAIN))
        self.seeds.append(state)
        next_at = time.monotonic()
        while self.sent < self.n_fuzz and not self.stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at += self.interval
            seed = self.rng.choice(self.seeds)
            self._publish(self.rng.choice(topics), self._mutate(seed))
            self.sent += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.c.disconnect()
        self.c.loop_stop()


# ---------------------------------------------------------------------- the run
class Soak:
    def __init__(self, plan: Plan, work: Path, seed: int) -> None:
        self.plan = plan
        self.work = work
        self.rng = random.Random(seed)
        self.cfg = work / "soak.yaml"
        # The last eight ids: fuzzer, aux poisoner, flapper, flooder, slow flipper, heavy-header
        # sender (and backlog publisher), and the extreme-utility pair.
        n = plan.clients + 8
        write_config(self.cfg, n)
        self.broker = MosquittoBroker(n, run_id=RUN, workdir=work / "broker")
        self.users = json.loads(self.broker.credentials_file.read_text())
        self.ck = work / "ck.safetensors"
        self.out = work / "out"
        self.server: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self.server_crashes = 0
        self.durable: set[int] = set()  # task ids applied and checkpointed by lives that were killed
        self.t0 = time.time()
        size = plan.clients // plan.groups
        self.groups = [
            (g * size, (g + 1) * size - 1 if g < plan.groups - 1 else plan.clients - 1)
            for g in range(plan.groups)
        ]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.rss_start: float | None = None
        self.rss_end: float | None = None
        # The attack measurement (measure_attack).
        self.quiet = self.attack = self.attack_wall_s = self.flapper_amplification = 0.0
        self.quiet_updates = self.attack_updates = 0.0
        self.attack_up = self.attack_down = self.attack_flips = self.attack_msgs_down = self.largest_task = 0
        self.slow_amplification = self.slow_broker_amplification = 0.0
        self.slow_flips = self.slow_msgs_down = self.slow_http_bytes = 0
        self.heavy_sent = 0
        self.backlog: HeavySender | None = None  # publishes the backlog before the first resume
        self.resume_after_backlog_s: float | None = None

    def _common(self) -> list[str]:
        return [
            str(self.cfg),
            "--broker",
            self.broker.address,
            "--run-id",
            RUN,
            "--time-scale",
            str(self.plan.scale),
        ]

    def _spawn(
        self, args: list[str], logname: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with open(self.work / logname, "ab") as f:
            return subprocess.Popen(
                [sys.executable, "-m", "felix.deploy", "-v", *args],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    admission = True
    model_http = False  # tasks name their model by hash, fetched over HTTP (felix serve --model-http)

    def start_server(self, resume: bool) -> None:
        args = ["serve", *self._common(), "--out", str(self.out), "--checkpoint", str(self.ck)]
        if self.model_http:
            args += ["--model-http", "127.0.0.1:0"]
        if not self.admission:  # the comparison: no intake limit, no damping, no task budget
            args += ["--client-msg-rate", "0", "--download-ratio", "0"]
            args += [
                "--set",
                "orchestrator.admission.flap_limit=null",
                "--set",
                "orchestrator.admission.task_rate=null",
                "--set",
                "orchestrator.admission.drop_rate=null",
            ]
        if resume:
            args.append("--resume")
        env = {"FELIX_MQTT_PASSWORD": self.users[SERVER_USER]}
        self.server = self._spawn(args, f"server-{self.lives}.log", env)
        self.lives += 1

    def start_group(self, g: int) -> None:
        lo, hi = self.groups[g]
        self.procs[g] = self._spawn(
            [
                "client",
                *self._common(),
                "--credentials",
                str(self.broker.credentials_file),
                "--ids",
                f"{lo}-{hi}",
                "--t0",
                repr(self.t0),
            ],
            f"clients-{g}.log",
        )

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Wait until the current server life logs that it serves (it imports torch and loads the
        dataset first; a signal before that would just kill it)."""
        path = self.work / f"server-{self.lives - 1}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "serving run" in path.read_text(errors="replace"):
                return
            if self.server is not None and self.server.poll() is not None:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the server did not start serving within {timeout:.0f} s")

    def check_server(self) -> None:
        """A server that exited on its own crashed: count it and resume it."""
        if self.server is not None and self.server.poll() is not None:
            self.server_crashes += 1
            log(f"server exited by itself (code {self.server.returncode}); resuming")
            self.start_server(resume=self.ck.exists())

    def kill_server(self) -> None:
        assert self.server is not None
        self.check_server()
        self.wait_serving()
        self.server.send_signal(signal.SIGKILL)
        self.server.wait(10)
        try:
            pos = ckpt.load_checkpoint(self.ck)["shell"]["applied"]
            with open(ckpt.applied_log_path(self.ck), newline="") as f:
                rows = list(csv.DictReader(f))[: int(pos["count"])]
            self.durable |= {int(r["task_id"]) for r in rows}
        except (ckpt.CheckpointError, OSError, KeyError):
            pass
        time.sleep(0.5)
        backlog, self.backlog = self.backlog, None
        if backlog is not None:
            log("the server is down: 70 x 1 MB published on one login's result topic")
            backlog.backlog(70, 1 << 20)
        t0 = time.monotonic()
        self.start_server(resume=self.ck.exists())
        self.wait_serving()  # the schedule's clock stands still while the server is loading
        if backlog is not None:
            self.resume_after_backlog_s = time.monotonic() - t0
            log(f"resumed over the backlog: serving after {self.resume_after_backlog_s:.1f} s")

    poison = "all"

    def run(self, fuzzer_seed: int) -> dict[str, Any]:
        p = self.plan
        self.broker.start()
        self.start_server(resume=False)
        for g in range(len(self.groups)):
            self.start_group(g)
        ids = [p.clients + i for i in range(8)]
        counts = hostile_class_counts(self.cfg, ids)
        fz = Fuzzer(
            self.broker.port,
            self.users[client_user(ids[0])],
            ids[0],
            p.fuzz,
            p.duration_s * 0.8,
            fuzzer_seed,
            counts[ids[0]],
            self.poison,
        )
        port = self.broker.port

        def login(i: int) -> tuple[int, str, int, tuple[int, ...]]:
            return (port, self.users[client_user(ids[i])], ids[i], counts[ids[i]])

        poisoner = AuxPoisoner(*login(1), "ap")
        heavy = HeavySender(*login(5), "hh", per_s=p.heavy_per_s)
        attackers = [
            Flapper(*login(2), "fl", per_s=p.flap_per_s),
            Flapper(*login(3), "fd", per_s=p.flood_per_s),
            # 26 changes per config minute: under the flap limit of 100
            Flapper(*login(4), "sf", per_s=26 / 60 / p.scale),
            heavy,
        ]
        extreme = [
            ExtremeUtility(*login(6), "x1", utility=1.7e308),
            ExtremeUtility(*login(7), "x2", utility=1e36),
        ]
        deadline = time.monotonic() + 180
        while not self.ck.exists():  # warm: the first version is checkpointed
            if time.monotonic() > deadline:
                raise RuntimeError("no checkpoint within 180 s of the start")
            self.check_server()
            time.sleep(0.2)
        log("warm: the first checkpoint is written; the quiet window starts")
        if self.server is not None:
            self.rss_start = rss_mb(self.server.pid)
        try:
            self.measure_attack(attackers)
        finally:
            for a in attackers:
                if a is not heavy:
                    a.close()
        self.backlog = heavy
        log("the attack window is over; the schedule starts")
        started = time.monotonic()
        # Events at evenly spaced times over the run (after a warm-up fifth), in a shuffled order.
        group_size = self.groups[0][1] - self.groups[0][0] + 1
        events = (
            ["client"] * -(-p.client_kills // group_size)
            + ["broker"] * p.broker_kills
            + ["server"] * p.server_kills
        )
        self.rng.shuffle(events)
        at = [p.duration_s * (0.2 + 0.75 * (i + 1) / (len(events) + 1)) for i in range(len(events))]
        fz.thread.start()
        killed_clients = 0
        try:
            for when, what in zip(at, events, strict=True):
                while time.monotonic() - started < when:
                    time.sleep(0.2)
                    self.check_server()
                if what == "client":
                    g = self.rng.randrange(len(self.groups))
                    self.procs[g].send_signal(signal.SIGKILL)
                    self.procs[g].wait(10)
                    killed_clients += self.groups[g][1] - self.groups[g][0] + 1
                    log(f"killed clients {self.groups[g][0]}-{self.groups[g][1]} (SIGKILL); restarting them")
                    time.sleep(0.5)
                    self.start_group(g)
                elif what == "broker":
                    log("killed the broker (SIGKILL); restarting it")
                    self.broker.restart(down_s=0.5, crash=True)
                else:
                    log("killed the server (SIGKILL); resuming it")
                    t_kill = time.monotonic()
                    self.kill_server()
                    started += time.monotonic() - t_kill  # the outage does not eat the schedule
            while time.monotonic() - started < p.duration_s:
                time.sleep(0.2)
                self.check_server()
            if self.server is not None:
                self.wait_serving()
                time.sleep(1.0)
                self.rss_end = rss_mb(self.server.pid)
                self.server.send_signal(signal.SIGTERM)  # interrupted: final checkpoint and outputs
                try:
                    self.server.wait(60)
                except subprocess.TimeoutExpired:
                    self.server.kill()
                    self.server_crashes += 1
        finally:
            fz.close()
            poisoner.close()
            for h in [heavy, *extreme]:
                h.close()
            for proc in [*self.procs.values(), *([self.server] if self.server else [])]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.broker.close()
        return self._result(fz, poisoner, killed_clients, extreme)

    def versions(self) -> tuple[int, int]:
        """The newest model version and the updates applied, from the applied-update log (written
        at each checkpoint)."""
        try:
            with open(ckpt.applied_log_path(self.ck), newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return 0, 0
        return max((int(r["version"]) for r in rows), default=0), len(rows)

    def _window(self) -> tuple[float, float]:
        """Versions and applied updates per wall second over one window of ``attack_s``."""
        t0, (v0, u0) = time.monotonic(), self.versions()
        while time.monotonic() - t0 < self.plan.attack_s:
            time.sleep(0.2)
            self.check_server()
        v1, u1 = self.versions()
        wall = time.monotonic() - t0
        return (v1 - v0) / wall, (u1 - u0) / wall

    def measure_attack(self, attackers: list[Flapper]) -> None:
        """The quiet window, then the attack window (no kills or fuzzing in either); the
        attackers' bytes are those of the attack window and one second after it."""
        self.quiet, self.quiet_updates = self._window()
        log(f"quiet: {self.quiet:.2f} versions/s; the flapping and flooding clients start")
        t0 = time.monotonic()
        for a in attackers:
            a.active.set()
        self.attack, self.attack_updates = self._window()
        for a in attackers:
            a.active.clear()
        time.sleep(1.0)
        self.attack_wall_s = time.monotonic() - t0
        self.attack_up = sum(a.bytes_up for a in attackers)
        self.attack_down = sum(a.bytes_down for a in attackers)
        self.attack_flips = sum(a.flips for a in attackers)
        self.attack_msgs_down = sum(a.messages_down for a in attackers)
        flapper, slow = attackers[0], attackers[2]
        self.flapper_amplification = flapper.bytes_down / max(1, flapper.bytes_up)
        self.slow_amplification = slow.bytes_down / max(1, slow.bytes_up)
        self.slow_http_bytes = slow.http_bytes_down
        self.slow_broker_amplification = (slow.bytes_down - slow.http_bytes_down) / max(1, slow.bytes_up)
        self.slow_flips = slow.flips
        self.slow_msgs_down = slow.messages_down
        log(f"slow flipper: {slow.flips} flips ({slow.bytes_up} B up) from {t0:.1f}; sent {slow.downs}")
        self.heavy_sent = attackers[3].flips
        self.largest_task = max(a.largest_down for a in attackers)
        log(
            f"attack: {self.attack:.2f} versions/s; {self.attack_flips} flips sent "
            f"({self.attack_up} B up), {self.attack_msgs_down} messages down ({self.attack_down} B)"
        )

    def amplification_bound(self, largest_task: int) -> float:
        """What admission control allows the attackers to be sent, over what they sent (see the
        module docstring), at the config's defaults."""
        a = AdmissionConfig()
        config_s = self.attack_wall_s / self.plan.scale
        budget = 2 * (a.task_burst + (a.task_rate or math.inf) * config_s) + 2
        damping = math.inf if a.flap_limit is None else 2 * (a.flap_limit + 2)
        per_attacker = min(budget, damping)
        return 2 * per_attacker * largest_task / max(1, self.attack_up)

    def _result(
        self, fz: Fuzzer, poisoner: AuxPoisoner, killed_clients: int, extreme: list[ExtremeUtility]
    ) -> dict[str, Any]:
        summary_path = self.out / "summary.json"
        if summary_path.exists():
            summ = json.loads(summary_path.read_text())
            with open(self.out / "applied_updates.csv", newline="") as f:
                final = [int(r["task_id"]) for r in csv.DictReader(f)]
        else:  # the last life crashed: what its checkpoint holds is the final state
            log("no summary: the last server life did not stop cleanly; reading its checkpoint")
            doc = ckpt.load_checkpoint(self.ck)
            shell = doc["shell"]
            with open(ckpt.applied_log_path(self.ck), newline="") as f:
                final = [int(r["task_id"]) for r in csv.DictReader(f)][: int(shell["applied"]["count"])]
            summ = {
                "wall_time_s": shell["wall_elapsed"],
                "transport": shell["stats"],
                "aggregations": doc["orchestrator"]["version"],
            }
        wall = max(1e-9, float(summ["wall_time_s"]))
        t = summ["transport"]
        crashed_logs = sum(
            "Traceback" in p.read_text(errors="replace") for p in self.work.glob("server-*.log")
        )
        out = {
            "acked_lost": len(self.durable - set(final)),
            "applied_twice": len(final) - len(set(final)),
            "server_crashes": max(self.server_crashes, crashed_logs),
            "bad_updates_applied": len((fz.poisoned | poisoner.poisoned | extreme[0].answered) & set(final)),
            "poisoning_attempts": fz.poison_attempts,
            "rss_start_mb": None if self.rss_start is None else round(self.rss_start, 1),
            "rss_end_mb": None if self.rss_end is None else round(self.rss_end, 1),
            "tier_msgs_per_s": round(t["tier_messages"] / wall, 1),
            "round_trips_per_s": round(t["results"] / wall, 1),
            "aux_poisoning_attempts": len(poisoner.poisoned),
            "attack_msgs_per_s": round(self.attack_flips / max(1e-9, self.attack_wall_s), 1),
            "attack_bytes_up": self.attack_up,
            "attack_bytes_down": self.attack_down,
            "amplification": round(self.attack_down / max(1, self.attack_up), 4),
            "amplification_bound": round(
                self.amplification_bound(max(self.largest_task, poisoner.largest_down)), 4
            )
            if self.admission
            else None,
            "flapper_amplification": round(self.flapper_amplification, 4),
            "versions_per_s_quiet": round(self.quiet, 2),
            "versions_per_s_attack": round(self.attack, 2),
            "updates_per_s_quiet": round(self.quiet_updates, 2),
            "updates_per_s_attack": round(self.attack_updates, 2),
            "throughput_ratio": round(self.attack / self.quiet, 3) if self.quiet > 0 else None,
            "rate_limited": sum(
                v
                for k, v in summ.get("rejected_by_reason", {}).items()
                if k.startswith("transport: rate limit")
            ),
            "damped": summ.get("admission", {}).get("damped"),
            "slow_flips": self.slow_flips,
            "slow_flipper_amplification": round(self.slow_amplification, 4),
            "slow_flipper_messages_down": self.slow_msgs_down,
            "slow_flipper_http_bytes_down": self.slow_http_bytes,
            "slow_flipper_broker_amplification": round(self.slow_broker_amplification, 4),
            "model_http": self.model_http,
            "heavy_headers_sent": self.heavy_sent,
            "extreme_utility_answers": [len(x.answered) for x in extreme],
            "resume_after_backlog_s": None
            if self.resume_after_backlog_s is None
            else round(self.resume_after_backlog_s, 1),
            "cost_limited": sum(
                v
                for k, v in summ.get("rejected_by_reason", {}).items()
                if k.startswith("transport: cost limit")
            ),
        }
        log(
            f"lives {self.lives}, clients killed {killed_clients}, fuzzed {fz.sent}, hostile client's "
            f"training tasks {fz.tasks_received}, poisoning attempts {fz.poison_attempts}, updates applied {len(final)}, aggregations {summ['aggregations']}, "
            f"rejected {t['rejected']}, duplicates {t['duplicates']}, durable-before-kill {len(self.durable)}"
        )
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="a few minutes: fewer kills, 1,000 fuzzed messages"
    )
    size.add_argument("--tiny", action="store_true", help="the test suite's version (about a minute)")
    ap.add_argument("--duration", type=float, help="seconds of soak (default: the plan's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--poison",
        choices=("all", "no-aux", "none"),
        default="all",
        help="poisoning attempts: all kinds; all but aux injection (to exercise the rest on a "
        "build whose server still dies of it); none",
    )
    ap.add_argument(
        "--no-admission",
        action="store_true",
        help="serve without the per-client message limit, flap damping and task budget (to compare)",
    )
    ap.add_argument(
        "--model-http",
        action="store_true",
        help="serve with --model-http: tasks name their model by hash, clients (and the hostile "
        "logins, each keeping the last model it fetched) download it over HTTP",
    )
    ap.add_argument("--keep", help="keep the run's files (logs, outputs) in this folder")
    args = ap.parse_args(argv)
    if find_mosquitto() is None:
        print("mosquitto is not installed (apt-get install mosquitto)", file=sys.stderr)
        return 2
    plan = PLANS["quick" if args.quick else "tiny" if args.tiny else "full"]
    if args.duration:
        plan = Plan(**{**plan.__dict__, "duration_s": args.duration})
    with tempfile.TemporaryDirectory(prefix="felix-soak-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        soak = Soak(plan, work, args.seed)
        soak.poison = args.poison
        soak.admission = not args.no_admission
        soak.model_http = args.model_http
        result = soak.run(args.seed + 1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
