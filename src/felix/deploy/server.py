"""The deployment shell around the orchestrator: wall clock, MQTT, evaluation, checkpoints.

It mirrors the simulation engine (``felix.sim.engine``): the same ``build_orchestrator`` and the
same run controller (``felix.engine.controller``: evaluations, stop rules, the modelled byte
accounting and the summary; the server adds the real wire bytes it saw), but time is the wall clock
(``time.monotonic()`` since the start, divided by ``--time-scale`` so that an emulated run keeps
the config's seconds) and clients are real MQTT peers. Every ``Tick`` is delivered at
``next_wakeup()``, so the 90 s task timers fire for real.

One loop thread owns the orchestrator: paho's network thread only puts received messages on a
queue (``felix.deploy.link``). For each message the loop checks, in order: the topic, the
sender's message budget (a token bucket per client, ``client_msg_rate`` per config second up to
``client_msg_burst``; checked before decoding, so a flood costs a topic parse per message), the
header (``wire.decode``: magic, version, type, field types, sizes), that the header's client id
is the topic's (the broker's ACL ties the topic to the login), the run id, and the message id
(a byte-identical repeat is an at-least-once duplicate, counted and dropped; the same id with
other content is a replay and rejected). ``wire.decode`` also refuses aux entries the objective
and aggregator do not declare. The orchestrator then checks what it knows: client, task, shape,
dtype, finite values, and the update validator's bounds (``felix.core.validation``: samples,
norm). Every rejection is logged with its reason and counted in ``summary.json`` under
``rejected_by_reason``; nothing rejected is applied. A message whose handling raises is rejected
too ("internal error") and acknowledged like any other: no client message stops the server.

Duplicates are recognised by what a message is about, not by remembering every message id:
a result by its task id (the result that closed a task is remembered by digest, a bounded
number of them), a REGISTER or STATE by its sender's sequence number (message ids are
``<incarnation>-<sequence>``; one watermark per client and id prefix, a few prefixes per client).

Exactly once: the orchestrator applies a task's result at most once (it closes the task on the
first accepted result); the server acknowledges inbound messages to the broker only after the
checkpoint that holds their effect is on disk (``--checkpoint``), so after a crash the broker
redelivers exactly the messages the restored state has not seen. Without a checkpoint, messages
are acknowledged as soon as they are handled. Pending acknowledgements keep no payload (a
message's effect is applied at once; only its broker packet id waits), and when they reach
``max_pending_bytes`` of inbound payload or ``max_pending_messages`` the server takes a
checkpoint at once (the back-pressure: a flood costs checkpoints, not memory). Checkpoints are
grouped (at most one per ``checkpoint_interval_s``, 0.2 s): one covers every aggregation since
the last, so their cost does not grow with the aggregation rate. Messages wait for the loop in
a bounded inbox (``max_inbox_bytes`` / ``max_inbox_messages``, :mod:`felix.deploy.inbox`): when it
is full paho's network thread waits, and TCP flow control pushes back on the broker.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from felix.config import Config
from felix.core.admission import TokenBuckets
from felix.core.commands import (
    CancelTask,
    Command,
    DispatchEval,
    DispatchTrain,
    NewModelVersion,
    UpdateRejected,
)
from felix.core.events import ClientRegistered, Event, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.types import ClientUpdate, TaskKind
from felix.deploy import checkpoint as ckpt
from felix.deploy import wire
from felix.deploy.broker_config import default_max_message_bytes
from felix.deploy.checkpoint import AppliedLog, AppliedUpdate
from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions, Connected, Inbound, MqttLink
from felix.deploy.topics import ALLOWED, Topics
from felix.engine.controller import RunController
from felix.metrics.recorder import EvalRow, Recorder
from felix.metrics.report import EvalLog, make_output_dir, tally_rejection
from felix.scenario.build import (
    attach_run_measures,
    build_orchestrator,
    build_population,
    build_trace,
    make_evaluator,
)
from felix.stream.setup import attach_freshness, build_stream
from felix.stream.summary import stream_summary

log = logging.getLogger("felix.deploy.server")

SEQ_PREFIXES_PER_CLIENT = 4  # message-id prefixes (incarnations, wills) whose sequence watermark is kept
INBOX_BATCH = 64  # inbound messages handled per loop turn at most (timers and commits run between turns)
RESULT_DIGESTS = 65536  # results remembered by task id (digest) to tell a redelivery from a replay
# A client's refused messages are all counted (summary: rejected_by_reason), but only its first
# REFUSALS_LOGGED and then every REFUSALS_LOG_EVERY-th are logged: one client publishing refused
# messages as fast as it can must not fill the server's disk with log lines. Nor may many clients
# (a population's worth of credentials, or made-up ids on a broker without ACLs): once
# REFUSALS_LOGGED_TOTAL lines have been logged in all, only every REFUSALS_LOG_EVERY-th refusal
# of the whole server is.
REFUSALS_LOGGED = 20
REFUSALS_LOGGED_TOTAL = 500
REFUSALS_LOG_EVERY = 1000


@dataclass
class TransportStats:
    messages_in: int = 0
    messages_out: int = 0
    duplicates: int = 0  # byte-identical redeliveries (QoS 1 at-least-once), dropped
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    registrations: int = 0
    re_registrations: int = 0
    client_restarts: int = 0
    tier_messages: int = 0
    results: int = 0
    reconnects: int = 0
    checkpoints: int = 0


@dataclass(frozen=True)
class ShadowTask:
    """What the shell remembers of a dispatched task, to check a result's kind and version."""

    client_id: int
    kind: TaskKind
    version: int


@dataclass(frozen=True)
class ServeOptions:
    broker: BrokerOptions
    run_id: str
    out_dir: Path | None = None
    checkpoint: Path | None = None
    resume: bool = False
    time_scale: float = 1.0  # wall seconds per config second
    max_message_bytes: int | None = None  # default: twice the model plus 1 MiB
    max_pending_bytes: int = 64 << 20  # inbound payload bytes handled but not yet acknowledged
    max_pending_messages: int = 10000  # ... and messages: reaching either forces a checkpoint
    max_inbox_bytes: int = 64 << 20  # inbound payload bytes received but not yet handled ...
    max_inbox_messages: int = 50000  # ... and messages: reaching either blocks paho's network thread
    checkpoint_interval_s: float = 0.2  # wall seconds between checkpoints at most (group commit)
    # Per-client message limit at intake (token bucket per client, in config seconds like the
    # orchestrator's rules): None turns it off.
    client_msg_rate: float | None = 10.0
    client_msg_burst: float = 50.0
    plots: bool = False
    status_every_s: float = 10.0


def _ms(values: deque[float], q: float) -> float | None:
    return round(1000.0 * float(np.percentile(values, q)), 2) if values else None


class Server:
    def __init__(self, cfg: Config, opts: ServeOptions) -> None:
        if opts.time_scale <= 0:
            raise ValueError("time scale must be positive")
        if opts.max_pending_bytes < 1 or opts.max_pending_messages < 1 or opts.checkpoint_interval_s < 0:
            raise ValueError("max pending bytes and messages must be positive, the checkpoint interval >= 0")
        if opts.client_msg_rate is not None and not (0 < opts.client_msg_rate < math.inf):
            raise ValueError(f"client message rate must be positive, not {opts.client_msg_rate}")
        if not (1 <= opts.client_msg_burst < math.inf):
            raise ValueError(f"client message burst must be at least 1, not {opts.client_msg_burst}")
        # Folders first: a run must not train for hours and then fail to write what it measured.
        if opts.out_dir is not None:
            make_output_dir(opts.out_dir)
        if opts.checkpoint is not None:
            make_output_dir(opts.checkpoint.parent, "checkpoint folder")
        # A client that never answers must not grow the server's open tasks with every timeout:
        # the deployment keeps one late task per client (orchestrator.one_late_task_per_client).
        cfg = cfg.model_copy(
            update={"orchestrator": cfg.orchestrator.model_copy(update={"one_late_task_per_client": True})}
        )
        self.cfg = cfg
        self.opts = opts
        self.topics = Topics(opts.run_id)
        pop = build_population(cfg)
        self.num_clients = cfg.partition.num_clients
        self.num_classes = pop.train.num_classes
        # Clients derive their data from the config's partition: none may claim more samples (the
        # registered count bounds every later result's num_samples, its weight and its norm bound).
        self.partition_sizes = [len(d) for d in pop.client_data]
        # Streaming data: the same stream model as the clients' (its mix judges the model, its
        # registration bounds the sample counts); no client's samples are drawn here.
        self.stream = None
        if cfg.stream.enabled:
            tied = cfg.stream.arrivals.kind == "availability"
            self.stream = build_stream(cfg, pop, build_trace(cfg, pop) if tied else None)
            self.partition_sizes = [self.stream.registration(c)[0] for c in range(self.num_clients)]
        self.num_params = int(pop.initial_weights.size)
        # The oracle baselines read the trace on the server's clock (clients replay it on theirs).
        # A data plan the registered counts make impossible is logged and training goes on without it.
        self.orch = build_orchestrator(
            cfg, pop.initial_weights, lambda: build_trace(cfg, pop), plan_errors="skip"
        )
        r = cfg.run
        rec = Recorder(
            make_evaluator(copy.deepcopy(pop.model), pop.test, r.device),
            r.target_accuracy,
            r.target_window,
            r.eval_every,
        )
        if r.per_client_eval or r.converge_threshold is not None:  # the same run measures as the simulator
            attach_run_measures(cfg, rec, pop, build_trace(cfg, pop))
        self.freshness = None if self.stream is None else attach_freshness(cfg, rec, pop, self.stream, None)
        sink = None if opts.out_dir is None else EvalLog(opts.out_dir / "evaluations.csv")
        self.ctl = RunController(cfg, self.orch, rec, sink, measure_wire=True)
        self.ctl.on_evaluation.append(_log_evaluation)
        default_bytes = default_max_message_bytes(self.num_params)
        self.max_bytes = default_bytes if opts.max_message_bytes is None else opts.max_message_bytes
        if self.max_bytes < 4 * self.num_params:  # also 0 or negative
            raise ValueError(
                f"max message bytes {self.max_bytes} cannot hold one result: its update alone is "
                f"{4 * self.num_params} bytes ({self.num_params} float32 parameters)"
            )
        self.stats = TransportStats()
        self._refused: dict[int, int] = {}  # client id (-1: none, or outside the population) -> refused
        self._refusals_logged = 0  # refusal lines logged in all, within REFUSALS_LOGGED_TOTAL
        # Each client's message budget (ids outside the population share one: key -1).
        self.msg_buckets = (
            None
            if opts.client_msg_rate is None
            else TokenBuckets(opts.client_msg_rate, opts.client_msg_burst)
        )
        self.applied = AppliedLog(None if opts.checkpoint is None else ckpt.applied_log_path(opts.checkpoint))
        self.seq_marks: dict[int, dict[str, int]] = {}  # client -> message-id prefix -> highest sequence
        self.result_digests: dict[int, bytes] = {}  # task id -> digest of the result that closed it
        self.incarnations: dict[int, str] = {}
        self.shadow: dict[int, ShadowTask] = {}
        self.plan_info: dict[str, Any] | None = None  # the data plan (lb / dafl), once computed
        self.session = secrets.token_hex(6)
        self.ids = wire.MsgIds(f"s{self.session}")
        self.life = 0
        self.inbox = Inbox(opts.max_inbox_bytes, opts.max_inbox_messages)
        self.stop_requested = threading.Event()  # Ctrl-C / SIGTERM (felix serve) or a test: stop cleanly
        self._pending_acks: list[
            tuple[int, int, int, int]
        ] = []  # (mid, qos, epoch, bytes): not yet acknowledged
        self._pending_bytes = 0
        self._checkpoint_due = False  # a new version (or the end) since the last checkpoint
        self._last_checkpoint = 0.0  # time.monotonic() of the last one
        # Delivery delay of recent inbound messages (receive time - the sender's "sent" stamp; one
        # clock on a single machine, clock skew across machines): the broker's and the loop's backlog.
        self.latency: deque[float] = deque(maxlen=4096)
        self._prior_wall = 0.0
        self._start_time = 0.0
        self.config_digest = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
        if opts.resume:
            self._restore()
        self.link = MqttLink(
            f"felix-{opts.run_id}-server",
            opts.broker,
            self.topics.server_subscriptions(),
            self.inbox.put,
            manual_ack=True,  # after handling, or after the checkpoint that holds the effect
            batch_sink=self.inbox.put_many,
        )
        self._mono0 = time.monotonic()

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        return self._start_time + (time.monotonic() - self._mono0) / self.opts.time_scale

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, Any]:
        """Serve until the target, ``max_time_s``, ``max_aggregations`` or ``stop_requested``."""
        self.link.start(fresh=not self.opts.resume)
        self._mono0 = time.monotonic()
        self.ctl.start()
        log.info(
            "serving run %s (session %s, life %d) on %s:%d",
            self.opts.run_id,
            self.session,
            self.life,
            self.opts.broker.host,
            self.opts.broker.port,
        )
        last_status = time.monotonic()
        while self.ctl.stop_reason is None:
            wake = self.orch.next_wakeup()
            now = self.now()
            timeout = 0.25 if wake is None else min(0.25, max(0.0, (wake - now) * self.opts.time_scale))
            for _, item in self.inbox.get_batch(timeout, INBOX_BATCH):
                if self.ctl.stop_reason is not None:
                    break  # the rest stays unacknowledged: the broker redelivers it to the next session
                if isinstance(item, Connected):
                    self._on_connected(item)
                else:
                    self.handle_inbound(item)
            now = self.now()
            wake = self.orch.next_wakeup()
            if wake is not None and wake <= now and self.ctl.stop_reason is None:
                self._deliver(Tick(now), from_client=False)
            self._commit()
            self.ctl.past_time_limit(now)
            if self.stop_requested.is_set():
                self.ctl.request_stop()
            if time.monotonic() - last_status >= self.opts.status_every_s:
                last_status = time.monotonic()
                self._log_status()
        return self._finish()

    def _log_status(self) -> None:
        o = self.orch
        rows = self.ctl.rec.rows
        acc = rows[-1].accuracy if rows else float("nan")
        log.info(
            "t=%.0fs version=%d accuracy=%.4f clients=%d in-flight=%d msgs-in=%d dup=%d rejected=%d",
            self.now(),
            o.version,
            acc,
            len(o.clients),
            sum(t.holds_slot for t in o.tasks()),
            self.stats.messages_in,
            self.stats.duplicates,
            self.stats.rejected,
        )

    def _finish(self) -> dict[str, Any]:
        now = self.now()
        self.ctl.finish(now)
        if self.opts.checkpoint is not None:
            self._checkpoint_due = True  # the final state: --resume after an interruption continues here
        self._commit(force=True)
        if self.ctl.stop_reason != "interrupted":
            self._publish_status("finished")  # retained: clients stop; an interrupted run waits for --resume
        self.inbox.close()  # a network thread blocked on a full inbox must not block the join
        self.link.close()
        self.applied.sync()
        summ = self.summary(now)
        if self.opts.out_dir is not None:
            self.write_outputs(summ)
        log.info("stopped (%s) at version %d after %.1f s", self.ctl.stop_reason, self.orch.version, now)
        return summ

    def summary(self, now: float) -> dict[str, Any]:
        wall = self._prior_wall + (time.monotonic() - self._mono0)
        extra = {
            "rejected_by_reason": dict(sorted(self.stats.rejected_by_reason.items())),
            "transport": {
                **{k: v for k, v in asdict(self.stats).items() if k != "rejected_by_reason"},
                "latency_p50_ms": _ms(self.latency, 50),
                "latency_p95_ms": _ms(self.latency, 95),
                "inbox_full_waits": self.inbox.full_waits,
            },
            "admission": asdict(self.orch.admission.stats),
            "deployment": {
                "run_id": self.opts.run_id,
                "time_scale": self.opts.time_scale,
                "lives": self.life + 1,
                "broker": f"{self.opts.broker.host}:{self.opts.broker.port}",
                "tls": self.opts.broker.tls_ca is not None,
                "applied_task_ids_unique": self.applied.unique,
            },
        }
        if self.plan_info is not None:
            extra["data_plan"] = self.plan_info
        extra.update(stream_summary(self, now))
        return self.ctl.summary(now, wall, extra)

    def write_outputs(self, summ: dict[str, Any]) -> None:
        out = self.opts.out_dir
        assert out is not None
        self.ctl.write_outputs(out, summ, self.opts.plots)
        self.applied.write_csv(out / "applied_updates.csv")
        if self.freshness is not None:
            self.freshness.write(out, float(summ["virtual_time_s"]), self.opts.plots)

    # ------------------------------------------------------------------ inbound
    def _on_connected(self, c: Connected) -> None:
        if c.epoch > 1:
            self.stats.reconnects += 1
            # The broker redelivers every unacknowledged message on the new connection.
            self._pending_acks = [m for m in self._pending_acks if m[2] >= c.epoch]
            self._pending_bytes = sum(m[3] for m in self._pending_acks)
        self._publish_status("running")  # retained; after a reconnect too, in case the broker lost it

    def _reject(self, cid: int, task_id: int, reason: str, detail: str = "", error: bool = False) -> None:
        """Count a refused message; log it within the per-client and the server-wide limits
        (``error``: with the traceback of the exception being handled)."""
        self.stats.rejected += 1
        total = self.stats.rejected
        tally_rejection(self.stats.rejected_by_reason, reason)
        # Ids outside the population share one count: a broker without ACLs lets anyone publish
        # under any id, and a count per id would grow with every id made up.
        key = cid if 0 <= cid < self.num_clients else -1
        n = self._refused[key] = self._refused.get(key, 0) + 1
        if (
            n <= REFUSALS_LOGGED or n % REFUSALS_LOG_EVERY == 0
        ) and self._refusals_logged < REFUSALS_LOGGED_TOTAL:
            self._refusals_logged += 1
            if self._refusals_logged == REFUSALS_LOGGED_TOTAL:
                note = f" [{total} refused in all; from now on every {REFUSALS_LOG_EVERY}th of the server's is logged]"
            elif n >= REFUSALS_LOGGED:
                note = f" [{n} refused from this client; from now on every {REFUSALS_LOG_EVERY}th is logged]"
            else:
                note = ""
        elif total % REFUSALS_LOG_EVERY == 0:
            note = f" [{total} refused in all, {n} from this client; every {REFUSALS_LOG_EVERY}th is logged]"
        else:
            return
        log.warning(
            "rejected message from client %d (task %d): %s%s%s",
            cid,
            task_id,
            reason,
            f" ({detail})" if detail else "",
            note,
            exc_info=error,
        )

    def handle_inbound(self, m: Inbound) -> None:
        """Handle one inbound message; its acknowledgement waits (without its payload) for the next
        durable point, which comes early when the pending bound is reached. If handling raises, the
        message is rejected and acknowledged with the others (so the broker does not redeliver
        it): no client message stops the server."""
        self._pending_acks.append((m.mid, m.qos, m.epoch, len(m.payload)))
        self._pending_bytes += len(m.payload)
        try:
            self._on_inbound(m)
        except Exception as exc:  # noqa: BLE001 - any client message is hostile; the loop must survive it
            parsed = self.topics.parse_inbound_to_server(m.topic)
            self._reject(
                parsed[1] if parsed else -1,
                0,
                f"internal error: {type(exc).__name__}",
                f"handling a message on {m.topic[:80]}: {str(exc)[:200]}",
                error=True,
            )
        if (
            self._pending_bytes >= self.opts.max_pending_bytes
            or len(self._pending_acks) >= self.opts.max_pending_messages
        ):
            self._checkpoint_due = True

    def _on_inbound(self, m: Inbound) -> None:
        self.stats.messages_in += 1
        parsed = self.topics.parse_inbound_to_server(m.topic)
        if parsed is None:
            self._reject(-1, 0, f"transport: message on an unexpected topic {m.topic[:80]!r}")
            return
        kind, cid = parsed
        if self.msg_buckets is not None and not self.msg_buckets.take(
            cid if 0 <= cid < self.num_clients else -1, self.now()
        ):
            # Before decoding: a flood costs the server a topic parse and a counter per message.
            self.ctl.count_wire("up", "control", len(m.payload))
            self._reject(cid, 0, f"transport: rate limit ({kind})")
            return
        try:
            msg = wire.decode(m.payload, self.max_bytes, self.orch.validator.aux_spec)
        except wire.MessageError as exc:
            self.ctl.count_wire("up", "control", len(m.payload))
            self._reject(cid, 0, f"transport: {exc.code.value}", exc.detail)
            return
        self._count_up(msg, len(m.payload))
        self.latency.append(max(0.0, time.time() - msg.sent_at))
        if msg.TYPE not in ALLOWED[kind]:
            self._reject(cid, 0, f"transport: {msg.TYPE.value} message on a {kind} topic")
            return
        if msg.run != self.opts.run_id:
            self._reject(cid, 0, f"transport: message for run {msg.run!r}")
            return
        sender = getattr(msg, "client", None)
        if sender != cid:
            self._reject(
                cid,
                getattr(msg, "task", 0),
                f"transport: sender mismatch: header says client {sender}, topic belongs to client {cid}",
            )
            return
        if not self._first_delivery(cid, msg, m.payload):
            return
        if cid >= self.num_clients:
            self._reject(
                cid, 0, f"transport: client id {cid} is outside the population of {self.num_clients}"
            )
            return
        if isinstance(msg, wire.Register):
            self._on_register(msg)
        elif isinstance(msg, wire.State):
            self._on_state(msg)
        elif isinstance(msg, wire.Result):
            if self._on_result(msg):
                self._remember_result(msg, m.payload)
        elif isinstance(msg, wire.Failed) and self._deliver(
            TaskFailed(self.now(), cid, msg.task, msg.reason)
        ):
            self._remember_result(msg, m.payload)

    def _count_up(self, msg: wire.Message, n: int) -> None:
        kind = msg.kind.value if isinstance(msg, wire.Result) else "control"
        self.ctl.count_wire("up", kind, n)

    def _first_delivery(self, cid: int, msg: wire.Message, payload: bytes) -> bool:
        """Duplicate check; True if the message is new (or a replay the orchestrator will refuse).

        Results and failure reports are about a task: the result that closed a task is kept by
        digest (message id and content), so a verbatim redelivery is a duplicate and the same
        id with other content a replay; any other message for a closed task reaches the
        orchestrator, which refuses it. REGISTER and STATE carry ``<prefix>-<sequence>`` ids
        that grow per sender: anything at or below the prefix's watermark was seen already.
        """
        if isinstance(msg, (wire.Result, wire.Failed)):
            prior = self.result_digests.get(msg.task)
            if prior is None:
                return True
            digest = _digest(msg.msg_id, payload)
            if prior == digest:
                self.stats.duplicates += 1
                log.debug("duplicate delivery of %s from client %d dropped", msg.msg_id, cid)
                return False
            if prior[:8] == digest[:8]:
                self._reject(cid, msg.task, "transport: replayed message id with different content")
                return False
            return True
        prefix, sep, seq = msg.msg_id.rpartition("-")
        if not sep or not seq.isdigit() or len(seq) > 18:
            self._reject(cid, 0, "transport: message id is not <incarnation>-<sequence>")
            return False
        marks = self.seq_marks.setdefault(cid, {})
        n = int(seq)
        if n <= marks.get(prefix, -1):
            self.stats.duplicates += 1
            return False
        marks.pop(prefix, None)
        marks[prefix] = n  # most recently used last
        if len(marks) > SEQ_PREFIXES_PER_CLIENT:
            del marks[next(iter(marks))]
        return True

    def _remember_result(self, msg: wire.Result | wire.Failed, payload: bytes) -> None:
        self.result_digests[msg.task] = _digest(msg.msg_id, payload)
        if len(self.result_digests) > RESULT_DIGESTS:
            for t in list(self.result_digests)[: RESULT_DIGESTS // 2]:
                del self.result_digests[t]

    def _on_register(self, msg: wire.Register) -> None:
        cid, now = msg.client, self.now()
        self.stats.registrations += 1
        counts = msg.class_counts
        if len(counts) != self.num_classes or sum(counts) != msg.num_samples:
            self._reject(
                cid,
                0,
                "transport: registration's class counts do not match the classes or the samples",
                f"{len(counts)} counts summing to {sum(counts)} for {msg.num_samples} samples, "
                f"{self.num_classes} classes",
            )
            return
        most = self.partition_sizes[cid] + sum(self.orch.plans.get(cid, ()))  # after augmenting: plus its row
        if msg.num_samples > most:
            self._reject(
                cid,
                0,
                "transport: registration claims more samples than the client's partition holds",
                f"{msg.num_samples} > {most}",
            )
            return
        if cid not in self.orch.clients:
            self.incarnations[cid] = msg.incarnation
            self._deliver(ClientRegistered(now, cid, msg.num_samples, msg.tier, counts))
            self._maybe_plan()
            return
        # A known client registers again: the server restarted (same incarnation) or the client did
        # (new incarnation), in which case the task it held is gone with its process.
        self.stats.re_registrations += 1
        if self.incarnations.get(cid) != msg.incarnation:
            self.stats.client_restarts += 1
            self.incarnations[cid] = msg.incarnation
            held = self.orch.clients[cid].in_flight
            if held is not None:
                self._deliver(TaskFailed(now, cid, held, "client restarted"), from_client=False)
            late = self.orch.late_task(cid)  # a task it lost the slot of: no late reply will come either
            if late is not None:
                self._deliver(TaskFailed(now, cid, late, "client restarted"), from_client=False)
        self._deliver(TierChanged(now, cid, msg.tier))

    def _maybe_plan(self) -> None:
        """Note the data plan (``data_plan: lb | dafl``) when the orchestrator's data-plan policy has
        just made it (it plans once the whole population has registered, and holds the training
        tasks assigned before that until then; ``felix.strategies.dataplans.policy``)."""
        info = self.orch.data_plan.info()
        if self.plan_info is not None or not info:
            return
        self.plan_info = {**info, "planned_at_s": self.now()}
        if "error" not in info:
            log.info("data plan %s: %d samples to add across the clients", info["method"], info["added"])

    def _on_state(self, msg: wire.State) -> None:
        self.stats.tier_messages += 1
        known = self.incarnations.get(msg.client)
        if known is not None and known != msg.incarnation:
            # e.g. the will of a process that has since been restarted: its tier is not the client's.
            self._reject(msg.client, 0, "transport: tier report from a previous client incarnation")
            return
        self._deliver(TierChanged(self.now(), msg.client, msg.tier))

    def _on_result(self, msg: wire.Result) -> bool:
        """True if the orchestrator accepted the result (it closed its task)."""
        self.stats.results += 1
        shadow = self.shadow.get(msg.task)
        if shadow is not None and shadow.client_id == msg.client:
            if shadow.kind is not msg.kind:
                self._reject(msg.client, msg.task, f"{msg.kind.value} result for a {shadow.kind.value} task")
                return False
            if shadow.version != msg.version:
                self._reject(
                    msg.client,
                    msg.task,
                    f"result computed on version {msg.version}, "
                    f"task was dispatched with version {shadow.version}",
                )
                return False
        upd = ClientUpdate(
            num_samples=msg.num_samples,
            stat_utility=msg.stat_utility,
            loss=msg.loss,
            duration=msg.duration,
            delta=msg.delta,
            aux=dict(msg.aux),
            data_span=msg.data_span,
        )
        return self._deliver(TaskFinished(self.now(), msg.client, msg.task, upd))

    # ------------------------------------------------------------------ orchestrator
    def _deliver(self, event: Event, from_client: bool = True) -> bool:
        """Hand an event to the orchestrator (through the run controller) and carry out its
        commands; False if it was rejected. ``from_client``: the event is a client's message (its
        modelled bytes count), not one the server derived (a tick, a restart's lost task)."""
        commands = self.ctl.handle(event, from_client)
        rejected = any(isinstance(c, UpdateRejected) for c in commands)
        if isinstance(event, (TaskFinished, TaskFailed)) and not rejected:
            self.shadow.pop(event.task_id, None)
        for cmd in commands:
            if isinstance(cmd, NewModelVersion):
                self._log_applied(cmd)
                self._checkpoint_due = True
            self._apply(cmd)
        return not rejected

    def _commit(self, force: bool = False) -> None:
        """Acknowledge handled messages to the broker once their effect is durable.

        With a checkpoint file, that is after the checkpoint following a new model version (or
        reaching the pending bound); until then the broker holds the messages and would
        redeliver them to a restarted server. Checkpoints are grouped: at most one per
        ``checkpoint_interval_s`` (wall), covering every version since the last, unless the
        pending bound is reached or ``force`` (the end). Without a checkpoint file there is
        nothing durable to wait for.
        """
        if self.opts.checkpoint is None:
            self._ack(self._pending_acks)
            self._pending_acks = []
            self._pending_bytes = 0
            return
        if not self._checkpoint_due:
            return
        full = (
            self._pending_bytes >= self.opts.max_pending_bytes
            or len(self._pending_acks) >= self.opts.max_pending_messages
        )
        if not (force or full) and time.monotonic() - self._last_checkpoint < self.opts.checkpoint_interval_s:
            return
        self._checkpoint()
        self._last_checkpoint = time.monotonic()
        self._ack(self._pending_acks)
        self._pending_acks = []
        self._pending_bytes = 0
        self._checkpoint_due = False

    def _log_applied(self, cmd: NewModelVersion) -> None:
        r = cmd.report
        for task_id, cid, st, w in zip(r.task_ids, r.client_ids, r.staleness, r.weights, strict=True):
            self.applied.append(AppliedUpdate(cmd.version, task_id, cid, st, w, cmd.time))

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, DispatchTrain):
            msg: wire.Message = wire.TrainTask(
                **self._env(),
                client=cmd.client_id,
                task=cmd.task_id,
                version=cmd.version,
                plan=cmd.plan,
                weights=cmd.weights,
                aux=cmd.aux,
            )
            self.shadow[cmd.task_id] = ShadowTask(cmd.client_id, TaskKind.TRAIN, cmd.version)
            self._send(cmd.client_id, msg, "train")
        elif isinstance(cmd, DispatchEval):
            msg = wire.EvalTask(
                **self._env(),
                client=cmd.client_id,
                task=cmd.task_id,
                version=cmd.version,
                weights=cmd.weights,
            )
            self.shadow[cmd.task_id] = ShadowTask(cmd.client_id, TaskKind.EVAL, cmd.version)
            self._send(cmd.client_id, msg, "eval")
        elif isinstance(cmd, CancelTask):
            self.shadow.pop(cmd.task_id, None)
            self._send(
                cmd.client_id,
                wire.Cancel(**self._env(), client=cmd.client_id, task=cmd.task_id, reason=cmd.reason),
                "control",
            )
        elif isinstance(cmd, UpdateRejected):
            self._reject(cmd.client_id, cmd.task_id, cmd.reason)

    def _env(self) -> dict[str, Any]:
        return {"run": self.opts.run_id, "msg_id": self.ids.next(), "sent_at": time.time()}

    def _send(self, cid: int, msg: wire.Message, kind: str) -> None:
        payload = wire.encode(msg)
        self.link.publish(self.topics.task(cid), payload)
        self.stats.messages_out += 1
        self.ctl.count_wire("down", kind, len(payload))

    def _publish_status(self, state: str) -> None:
        msg = wire.Status(**self._env(), session=self.session, state=state)
        self.link.publish(self.topics.status, wire.encode(msg), retain=True)

    def _ack(self, items: list[tuple[int, int, int, int]]) -> None:
        self.link.ack_many([(mid, qos, epoch) for mid, qos, epoch, _ in items])

    # ------------------------------------------------------------------ checkpoints
    def _shell_state(self) -> dict[str, Any]:
        """The shell's part of a checkpoint, explicit and columnar like ``Orchestrator.state_dict``."""
        marks = [(c, p, n) for c, m in self.seq_marks.items() for p, n in m.items()]
        digests = self.result_digests
        sh = self.shadow
        return {
            "config_digest": self.config_digest,
            "run_id": self.opts.run_id,
            "life": self.life,
            "now": self.now(),
            "wall_unix": time.time(),
            "wall_elapsed": self._prior_wall + (time.monotonic() - self._mono0),
            "controller": self.ctl.state_dict(),
            "plan_info": self.plan_info,
            "stats": asdict(self.stats),
            "applied": self.applied.position(),
            "seq_marks": {
                "client": np.array([c for c, _, _ in marks], dtype=np.int64),
                "prefix": [p for _, p, _ in marks],
                "seq": np.array([n for _, _, n in marks], dtype=np.int64),
            },
            "result_digests": {
                "task": np.fromiter(digests.keys(), dtype=np.int64, count=len(digests)),
                "digest": np.frombuffer(b"".join(digests.values()), dtype=np.uint8),
            },
            "incarnations": {
                "client": np.fromiter(self.incarnations.keys(), dtype=np.int64, count=len(self.incarnations)),
                "incarnation": list(self.incarnations.values()),
            },
            "shadow": {
                "task": np.fromiter(sh.keys(), dtype=np.int64, count=len(sh)),
                "client": np.fromiter((t.client_id for t in sh.values()), dtype=np.int64, count=len(sh)),
                "train": np.fromiter(
                    (t.kind is TaskKind.TRAIN for t in sh.values()), dtype=np.int8, count=len(sh)
                ),
                "version": np.fromiter((t.version for t in sh.values()), dtype=np.int64, count=len(sh)),
            },
        }

    def _checkpoint(self) -> None:
        assert self.opts.checkpoint is not None
        self.applied.sync()  # the log first: the snapshot says how much of it counts
        n = ckpt.save_checkpoint(
            self.opts.checkpoint, {"orchestrator": self.orch.state_dict(), "shell": self._shell_state()}
        )
        self.stats.checkpoints += 1
        log.debug("checkpoint at version %d (%d bytes)", self.orch.version, n)

    def _restore(self) -> None:
        path = self.opts.checkpoint
        if path is None:
            raise ckpt.CheckpointError("--resume needs --checkpoint PATH")
        doc = ckpt.load_checkpoint(path)
        shell = doc.get("shell")
        if not isinstance(shell, dict) or not isinstance(doc.get("orchestrator"), dict):
            raise ckpt.CheckpointError(f"checkpoint {path} lacks the orchestrator's or the shell's state")
        if shell.get("config_digest") != self.config_digest:
            raise ckpt.CheckpointError(f"checkpoint {path} was written for a different configuration")
        if shell.get("run_id") != self.opts.run_id:
            raise ckpt.CheckpointError(f"checkpoint {path} belongs to run {shell.get('run_id')!r}")
        try:
            self.orch.load_state_dict(doc["orchestrator"])
            self._load_shell(shell)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ckpt.CheckpointError(
                f"checkpoint {path} is incomplete or from another version ({type(exc).__name__}: {exc})"
            ) from None
        self.applied.truncate(shell["applied"])
        self.life = int(shell["life"]) + 1
        self._prior_wall = float(shell["wall_elapsed"])
        # Downtime counts: a deployment's time-to-target includes its outages.
        down = max(0.0, time.time() - float(shell["wall_unix"]))
        self._start_time = float(shell["now"]) + down / self.opts.time_scale
        # Tasks dispatched after the checkpoint are unknown to the restored state; numbering this
        # life's tasks from a fresh range keeps their late results from matching new tasks.
        self.orch.reserve_task_ids(self.life * ckpt.RESUME_TASK_ID_STRIDE + 1)
        log.info(
            "resumed from %s at version %d (life %d, %.1f s down)", path, self.orch.version, self.life, down
        )

    def _load_shell(self, shell: dict[str, Any]) -> None:
        self.ctl.load_state_dict(shell["controller"])
        self.plan_info = shell["plan_info"]
        self.stats = TransportStats(**shell["stats"])
        sm = shell["seq_marks"]
        self.seq_marks = {}
        for c, p, n in zip(sm["client"].tolist(), sm["prefix"], sm["seq"].tolist(), strict=True):
            self.seq_marks.setdefault(c, {})[p] = n
        rd = shell["result_digests"]
        flat = rd["digest"].tobytes()
        self.result_digests = {t: flat[16 * i : 16 * (i + 1)] for i, t in enumerate(rd["task"].tolist())}
        inc = shell["incarnations"]
        self.incarnations = dict(zip(inc["client"].tolist(), inc["incarnation"], strict=True))
        sh = shell["shadow"]
        self.shadow = {
            t: ShadowTask(c, TaskKind.TRAIN if k else TaskKind.EVAL, v)
            for t, c, k, v in zip(
                sh["task"].tolist(),
                sh["client"].tolist(),
                sh["train"].tolist(),
                sh["version"].tolist(),
                strict=True,
            )
        }


def _digest(msg_id: str, payload: bytes) -> bytes:
    """16 bytes: 8 of the message id, 8 of the payload (a replay keeps the id, changes the rest)."""
    return (
        hashlib.blake2b(msg_id.encode(), digest_size=8).digest()
        + hashlib.blake2b(payload, digest_size=8).digest()
    )


def _log_evaluation(row: EvalRow) -> None:
    log.info("version %d at t=%.1fs: accuracy %.4f", row.version, row.time_s, row.accuracy)
