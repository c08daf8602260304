"""The deployment shell around the orchestrator: wall clock, MQTT, evaluation, checkpoints.

It mirrors the simulation engine (``felix.sim.simulation``): the same run plan (``felix.engine.plan``:
the scenario's facts, no client's data) and server side
(``felix.engine.setup.build_server_side``: orchestrator, evaluator, recorder and the run
controller with its evaluations, stop rules, modelled byte accounting and summary; the server adds
the real wire bytes it saw), but time is the wall clock (``time.monotonic()`` since the start,
divided by ``--time-scale`` so that an emulated run keeps the config's seconds) and clients are
real MQTT peers. Every ``Tick`` is delivered at ``next_wakeup()``, so the 90 s task timers fire
for real.

One loop thread owns the orchestrator: the link (``felix.deploy.transport``: MQTT by default,
``ServeOptions.transport``) only puts received deliveries on a queue. Each goes to the wire
protocol (``felix.deploy.protocol``, sans-I/O: address, sender's budget, format, run id,
sender, duplicates and replays, registration bounds, incarnations, a result's kind and
version), which answers with the orchestrator's events
or a typed refusal; the orchestrator then checks what it knows: client, task, shape, dtype,
finite values, and the update validator's bounds (``felix.core.validation``: samples, norm).
Every rejection is logged with its reason and counted in ``summary.json`` by reason
(``rejected_by_reason``) and by kind (``transport.refused_by_kind``); nothing rejected is
applied. A message whose handling raises is rejected too ("internal error") and acknowledged
like any other: no client message stops the server.

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

Secure aggregation (``secure_aggregation:``): the aggregator's sum mechanism runs its groups with
the clients over the link (``felix.deploy.secagg_groups``) from inside the aggregation; meanwhile
the loop handles only their messages and keeps every other one, unacknowledged, for after it, in a
stash bounded as the inbox is (:mod:`felix.deploy.stash`: charged to its sender's budget, and
back-pressure while full).

One file of about 740 lines on purpose: it is the one place where the wall clock, the link, the
inbox, checkpoints and acknowledgements meet, and their ordering (an ack only after the checkpoint
that holds its effect) is easiest to check when the loop that keeps it is read whole. What can
stand alone has moved out (refusal log, model hosting, decode worker, metrics).
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from felix.config import Config, ConfigError
from felix.core.admission import DEPLOY_DROP_RATE
from felix.core.commands import (
    Command,
    NewModelVersion,
    UpdateRejected,
)
from felix.core.events import Event, Tick
from felix.core.refusals import Refusal
from felix.deploy import checkpoint as ckpt
from felix.deploy import wire
from felix.deploy.broker_config import SERVER_RECEIVE_MAXIMUM, default_max_message_bytes
from felix.deploy.channels import Channel
from felix.deploy.checkpoint import AppliedLog, AppliedUpdate
from felix.deploy.decode_worker import DecodeWorker
from felix.deploy.download_budget import DownloadBudget
from felix.deploy.inbox import Inbox, Item
from felix.deploy.link import LinkError
from felix.deploy.link_process import LinkProcess
from felix.deploy.model_http import ModelServer
from felix.deploy.model_store import ModelHosting, ModelStore
from felix.deploy.protocol import (
    Duplicate,
    LiveOrchestration,
    ProtocolLimits,
    Received,
    Refused,
    SecAggIn,
    ServerProtocol,
    TransportStats,
)
from felix.deploy.refusal_log import RefusalLog
from felix.deploy.secagg_groups import NetworkGroups
from felix.deploy.stash import Stash
from felix.deploy.transport import Ack, Connected, Delivery, LinkOptions, ServerLink, ServerLinkArgs
from felix.deploy.transport import resolve as resolve_transport
from felix.engine.heap import gc_frozen
from felix.engine.plan import plan_run
from felix.engine.setup import build_server_side
from felix.metrics.recorder import EvalRow
from felix.metrics.report import EvalLog, make_output_dir
from felix.privacy.setup import use_os_noise
from felix.secagg.aggregate import SecureSum
from felix.secagg.refusals import SecAggRefusal
from felix.stream.summary import stream_summary

log = logging.getLogger("felix.deploy.server")

INBOX_BATCH = 64  # inbound messages handled per loop turn at most (timers and commits run between turns)
WORKER_MIN_BATCH = 8  # smaller batches are parsed in the loop, not sent to the decode worker


@dataclass(frozen=True)
class ServeOptions:
    broker: LinkOptions  # the transport's options model (MQTT: BrokerOptions)
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
    # Per-client cost limit at intake, per wall second (felix.deploy.protocol.CostBudget): the share
    # of one core its messages' decoding may take, and its payload bytes (None: four of the largest
    # messages a second, eight at once). ``client_cost_limit=False`` turns both off.
    client_cost_limit: bool = True
    client_cpu_share: float = 0.05
    client_bytes_per_s: float | None = None
    plots: bool = False
    status_every_s: float = 10.0
    transport: str = "mqtt"  # the registered transport (felix.deploy.transport) the server's link uses
    # Tasks name their model by hash, fetched over HTTP (felix.deploy.model_store; None: inside the task).
    models: ModelHosting | None = None
    decode_worker: bool = False  # parse inbound messages in a second process (felix.deploy.decode_worker)
    link_process: bool = False  # the transport's link in a process of its own (felix.deploy.link_process)
    secagg_stage_s: float | None = None  # overrides secure_aggregation.stage_timeout_s (wall seconds)
    # Per-login download budget (felix.deploy.download_budget): what a login is sent and leaves
    # unanswered stays under download_ratio times the bytes it sent (plus one task and one largest
    # task forgiven per download_forgive_s wall seconds). None turns it off.
    download_ratio: float | None = 1.0
    download_forgive_s: float = 600.0


class _Clocks(NamedTuple):
    """The loop's clocks as a batch of inbound messages is handled: config time (the events'),
    the wall clock (``time.monotonic``: budgets, the inbox delay) and Unix time (the delivery
    delay from the sender's stamp). A decode worker's batch reads them once, so a message's
    delays are taken when its batch's turn began."""

    now: float
    wall: float
    unix: float

    @classmethod
    def read(cls, srv: Server) -> _Clocks:
        return cls(srv.now(), time.monotonic(), time.time())


# What the intake decided before ``Server.handle_inbound``: refused at admission, a secure
# aggregation's envelope, or the message built from the decode worker's header (or the error that
# refuses it; any other exception building it is that message's internal error).
Verdict = Refused | SecAggIn | wire.Message | Exception


def _build(
    protocol: ServerProtocol, parsed: wire.Parsed | wire.Message | wire.MessageError, payload: bytes
) -> Verdict:
    """``ServerProtocol.build`` (a message the decode worker built, or refused, as it is), with an
    unexpected exception kept for its own message: one message's failure is not its batch's."""
    if not isinstance(parsed, wire.Parsed):
        return parsed
    try:
        return protocol.build(parsed, payload)
    except Exception as exc:  # noqa: BLE001 - a client's message may raise anything; refused when handled
        return exc


def _is_secagg(item: Item) -> bool:
    """Whether ``item`` is a client's secure-aggregation message (a group's stage answer)."""
    return isinstance(item, Delivery) and item.address is not None and item.address.channel is Channel.SECAGG


def _ms(values: deque[float], q: float) -> float | None:
    return round(1000.0 * float(np.percentile(values, q)), 2) if values else None


class Server:
    def __init__(self, cfg: Config, opts: ServeOptions) -> None:
        if cfg.secure_aggregation.enabled and cfg.privacy.enabled and cfg.privacy.adaptive_clip is not None:
            raise ConfigError(
                "secure_aggregation with privacy.adaptive_clip: deployed clients clip to a fixed clip_norm "
                "and the server cannot clip masked updates; set privacy.clip_norm without adaptive_clip"
            )
        if opts.time_scale <= 0:
            raise ValueError("time scale must be positive")
        if opts.max_pending_bytes < 1 or opts.max_pending_messages < 1 or opts.checkpoint_interval_s < 0:
            raise ValueError("max pending bytes and messages must be positive, the checkpoint interval >= 0")
        if not (0 < opts.client_cpu_share <= 1):
            raise ValueError(f"client CPU share must be in (0, 1], not {opts.client_cpu_share}")
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
        # Nor may one that flips its tier take a model download per flip: the drop budget
        # (felix.core.admission) is on unless the config sets it.
        adm = cfg.orchestrator.admission
        if "drop_rate" not in adm.model_fields_set:
            adm = adm.model_copy(update={"drop_rate": DEPLOY_DROP_RATE})
        cfg = cfg.model_copy(
            update={
                "orchestrator": cfg.orchestrator.model_copy(
                    update={"one_late_task_per_client": True, "admission": adm}
                )
            }
        )
        self.cfg = cfg
        self.opts = opts
        # The run's plan: the scenario's facts (the partition's sizes and class counts come from
        # the labels; no client's samples are gathered here), the trace built only if a part reads
        # it (the oracle baselines, the per-client measure, availability-tied arrivals).
        plan = plan_run(cfg)
        self.num_clients = cfg.partition.num_clients
        self.num_classes = plan.num_classes
        # Clients derive their data from the config's partition: none may claim more samples (the
        # registered count bounds every later result's num_samples, its weight and its norm bound).
        self.partition_sizes = list(plan.sizes)
        # Streaming data: the same stream model as the clients' (its mix judges the model, its
        # registration bounds the sample counts); no client's samples are drawn here.
        self.stream = plan.stream
        if self.stream is not None:
            self.partition_sizes = [self.stream.registration(c)[0] for c in range(self.num_clients)]
        self.num_params = int(plan.initial_weights.size)
        # A data plan the registered counts make impossible is logged and training goes on without it.
        sink = None
        if opts.out_dir is not None:
            sink = EvalLog(opts.out_dir / "evaluations.csv", epsilon=cfg.privacy.enabled)
        side = build_server_side(plan, plan_errors="skip", sink=sink, measure_wire=True)
        use_os_noise(
            side.orch, side.controller
        )  # a deployment's privacy noise comes from the OS's CSPRNG, not the seed
        self.orch, self.ctl, self.freshness = side.orch, side.controller, side.freshness
        self.ctl.on_evaluation.append(_log_evaluation)
        default_bytes = default_max_message_bytes(self.num_params)
        self.max_bytes = default_bytes if opts.max_message_bytes is None else opts.max_message_bytes
        if self.max_bytes < 4 * self.num_params:  # also 0 or negative
            raise ValueError(
                f"max message bytes {self.max_bytes} cannot hold one result: its update alone is "
                f"{4 * self.num_params} bytes ({self.num_params} float32 parameters)"
            )
        self.session = secrets.token_hex(6)
        # The wire protocol's checks and state (sans-I/O: felix.deploy.protocol); MQTT and the clock stay here.
        limits = ProtocolLimits(
            self.num_clients,
            self.num_classes,
            self.partition_sizes,
            self.max_bytes,
            self.orch.validator.aux_spec,
            opts.client_msg_rate,
            opts.client_msg_burst,
            cpu_share=opts.client_cpu_share if opts.client_cost_limit else None,
            bytes_per_s=(
                (opts.client_bytes_per_s or 4.0 * self.max_bytes) if opts.client_cost_limit else None
            ),
            bytes_burst=8.0 * self.max_bytes,
            sealed_length=self.num_params if cfg.secure_aggregation.enabled else None,
        )
        self.protocol = ServerProtocol(opts.run_id, self.session, limits, LiveOrchestration(self.orch))
        if opts.download_ratio is not None:
            self.protocol.downloads = DownloadBudget(
                opts.download_ratio, opts.download_forgive_s, self.orch.admission.hold
            )
        self._swept = 0.0  # time.monotonic() of the last forgiveness sweep
        self.refusals = RefusalLog(self.num_clients)
        # Secure aggregation: the aggregator's sum mechanism runs its groups with the clients, over
        # the link (felix.deploy.secagg_groups); messages that arrive meanwhile wait in the stash.
        self.secagg: NetworkGroups | None = None
        self._stash = Stash(opts.max_inbox_bytes, opts.max_inbox_messages)
        mech = self.orch.aggregator.privacy
        if isinstance(mech, SecureSum):
            sa = cfg.secure_aggregation
            stage_s = sa.stage_timeout_s if opts.secagg_stage_s is None else opts.secagg_stage_s
            self.secagg = NetworkGroups(opts.run_id, self._send_secagg, self._pump, stage_s, sa.stage_grace_s)
            mech.remote = self.secagg
        self.decoder: DecodeWorker | None = None  # started by run()
        self._parsing: list[Delivery] = []  # the admitted messages of the batch the decoder parses
        self.model_store: ModelStore | None = None
        self.model_server: ModelServer | None = None
        if opts.models is not None:
            self.model_store, self.model_server = _host_models(opts.models)
            self.protocol.models = self.model_store.ref
        self.applied = AppliedLog(None if opts.checkpoint is None else ckpt.applied_log_path(opts.checkpoint))
        self.plan_info: dict[str, Any] | None = None  # the data plan (lb / dafl), once computed
        self.life = 0
        self.inbox = Inbox(opts.max_inbox_bytes, opts.max_inbox_messages)
        self.stop_requested = threading.Event()  # Ctrl-C / SIGTERM (felix serve) or a test: stop cleanly
        self._pending_acks: list[tuple[Ack, int]] = []  # (ack, payload bytes): not yet acknowledged
        self._pending_bytes = 0
        self._checkpoint_due = False  # a new version (or the end) since the last checkpoint
        self._last_checkpoint = 0.0  # time.monotonic() of the last one
        # Delivery delay of recent inbound messages (receive time - the sender's "sent" stamp; one
        # clock on a single machine, clock skew across machines): the broker's and the loop's backlog.
        self.latency: deque[float] = deque(maxlen=4096)
        # Of that delay, the wait between the transport's receipt and the loop (the inbox's queue).
        self.inbox_delay: deque[float] = deque(maxlen=4096)
        self._prior_wall = 0.0
        self._start_time = 0.0
        self.config_digest = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
        if opts.resume:
            self._restore()
        # The server's own in-flight window at the broker, above every client's (the broker's
        # max_inflight_messages): room for all it may hold unacknowledged until its next
        # checkpoint, which comes at the latest when max_pending_messages are pending.
        window = min(SERVER_RECEIVE_MAXIMUM, 2 * opts.max_pending_messages)
        # Acknowledged after handling, or after the checkpoint that holds the effect.
        link_args = ServerLinkArgs(opts.run_id, opts.broker, window, self.inbox.put, self.inbox.put_many)
        transport = resolve_transport(opts.transport, opts.broker)
        self.link: ServerLink = (
            LinkProcess(opts.transport, link_args) if opts.link_process else transport.server_link(link_args)
        )
        self._mono0 = time.monotonic()

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        return self._start_time + (time.monotonic() - self._mono0) / self.opts.time_scale

    @property
    def stats(self) -> TransportStats:
        """The transport's counts (the protocol's, and the shell's reconnects and checkpoints)."""
        return self.protocol.stats

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, Any]:
        """Serve until the target, ``max_time_s``, ``max_aggregations`` or ``stop_requested``.

        Start-up cannot hang: the connection is bounded by the broker options' connect timeout,
        and the SUBACK is awaited inside the loop (a resumed session's queued backlog arrives
        before it, and the loop drains it through the bounded inbox and the intake limits); a
        SUBACK missing after that timeout ends the run with a LinkError, the inbox closed first so
        that no network thread stays blocked on it."""
        try:
            if self.model_server is not None:
                self.model_server.start()
            if self.opts.decode_worker:
                self.decoder = DecodeWorker(self.max_bytes, self.protocol.header_bytes)
            self.link.start(fresh=not self.opts.resume, stop=self.stop_requested)
            with gc_frozen():  # the start-up's objects out of the collector's passes (felix.engine.heap)
                return self._serve()
        except BaseException:
            self.inbox.close()
            self.link.close(timeout=1.0)
            raise
        finally:
            if self.model_server is not None:
                self.model_server.close()
            if self.decoder is not None:
                self.decoder.close()

    def _serve(self) -> dict[str, Any]:
        subscribed_by = time.monotonic() + self.opts.broker.connect_timeout_s
        self._mono0 = time.monotonic()
        self.ctl.start()
        log.info(
            "serving run %s (session %s, life %d) on %s",
            self.opts.run_id,
            self.session,
            self.life,
            self.opts.broker.describe(),
        )
        last_status = time.monotonic()
        while self.ctl.stop_reason is None:
            ready = self.link.ready()  # every turn: it raises LinkError once the link failed for good
            if subscribed_by and (ready or self._stop_before_subscribed(subscribed_by)):
                subscribed_by = 0.0
            wake = self.orch.next_wakeup()
            now = self.now()
            timeout = 0.25 if wake is None else min(0.25, max(0.0, (wake - now) * self.opts.time_scale))
            batch: list[Item] = []
            if self._stash:  # what waited out a secure aggregation comes first, in arrival order
                self._drain_stash()
            else:
                quick = bool(self._parsing)
                batch = [item for _, item in self.inbox.get_batch(0.0 if quick else timeout, INBOX_BATCH)]
            for item in self._intake(batch):
                if self.ctl.stop_reason is not None:
                    break  # the rest stays unacknowledged: the broker redelivers it to the next session
                if isinstance(item, Connected):
                    self._on_connected(item)
                elif isinstance(item, Delivery):
                    self.handle_inbound(item)
            if self.protocol.downloads is not None and time.monotonic() - self._swept >= 1.0:
                self._swept = time.monotonic()
                self.protocol.downloads.sweep(self._swept)  # debts forgiven: held logins released
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

    def _stop_before_subscribed(self, deadline: float) -> bool:
        """The SUBACK has not come: raise once ``deadline`` passed (True: a stop was requested)."""
        if self.stop_requested.is_set():
            return True
        if time.monotonic() > deadline:
            raise LinkError(
                f"the broker at {self.opts.broker.describe()} did not confirm the "
                f"server's subscriptions within {self.opts.broker.connect_timeout_s:.0f} s"
            )
        return False

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
            "rejected_by_kind": dict(sorted(self.stats.refused_by_kind.items())),
            "transport": {
                **{k: v for k, v in asdict(self.stats).items() if k != "rejected_by_reason"},
                "latency_p50_ms": _ms(self.latency, 50),
                "latency_p95_ms": _ms(self.latency, 95),
                "inbox_delay_p50_ms": _ms(self.inbox_delay, 50),
                "inbox_delay_p95_ms": _ms(self.inbox_delay, 95),
                "inbox_full_waits": self.inbox.full_waits,
                **(
                    {}
                    if self.secagg is None
                    else {
                        "secagg_stash_peak_messages": self._stash.peak_messages,
                        "secagg_stash_full_reads": self._stash.full_reads,
                    }
                ),
            },
            "admission": asdict(self.orch.admission.stats),
            "deployment": {
                "run_id": self.opts.run_id,
                "time_scale": self.opts.time_scale,
                "lives": self.life + 1,
                "broker": self.opts.broker.describe(),
                "tls": self.opts.broker.secure,
                "applied_task_ids_unique": self.applied.unique,
            },
        }
        if self.protocol.downloads is not None:
            extra["deployment"]["download_budget"] = asdict(self.protocol.downloads.stats)
        if self.model_store is not None:
            extra["deployment"]["models"] = {
                "url": self.model_store.url_base,
                **asdict(self.model_store.stats),
                **({} if self.model_server is None else asdict(self.model_server.stats)),
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
            # The broker redelivers every unacknowledged message on the new connection (of its
            # shard: the other brokers' connections, and what they delivered, are untouched).
            self._pending_acks = [
                m for m in self._pending_acks if m[0].shard != c.shard or m[0].epoch >= c.epoch
            ]
            self._pending_bytes = sum(m[1] for m in self._pending_acks)
        self._publish_status("running")  # retained; after a reconnect too, in case the broker lost it

    def _log_refusal(self, r: Refused, error: bool = False) -> None:
        """Log a refusal (the protocol counted it) within bounds (``felix.deploy.refusal_log``)."""
        self.refusals.log(r, self.stats.rejected, error)

    def _intake(self, batch: list[Item]) -> list[Item]:
        """What of ``batch`` the loop handles itself. With a decode worker, a batch of
        ``WORKER_MIN_BATCH`` messages or more goes through the pipeline (none is left); a smaller
        one, or one that holds a reconnection (handled after what came before it), is left to the
        loop after what is in flight: a round trip to the worker costs the loop more than parsing
        a few messages itself (``benchmarks/intake_cpu.py --batch``), and under load the batches
        grow past the bound."""
        if self.decoder is None:
            return batch
        deliveries = [i for i in batch if isinstance(i, Delivery)]
        if len(batch) >= WORKER_MIN_BATCH and len(deliveries) == len(batch):
            self._pipeline(self.decoder, deliveries)
            return []
        self._pipeline(self.decoder, [])
        return batch

    def _pipeline(self, decoder: DecodeWorker, batch: list[Delivery]) -> None:
        """With a decode worker: take the parsed results of the batch before, send this batch's
        admitted messages to the worker, and apply those results while it parses them (two cores);
        an empty batch only applies what is in flight. A message refused at admission (or on no
        known address) is handled at once: it has no effect but its count.

        The clocks are read once per batch (``_Clocks``), and the results are built in one pass
        (``ServerProtocol.build`` reads no state) timed as a whole: each message's decode charge
        is its parsing time in the worker plus its share, by that time, of the pass."""
        done = list(zip(self._parsing, decoder.collect(), strict=True))
        self._parsing = []
        clocks = _Clocks.read(self)
        for m in batch:
            refused = (
                self.protocol.admit(m.address, len(m.payload), clocks.now, clocks.wall)
                if m.address is not None
                else None
            )
            if m.address is not None and m.address.channel is Channel.SECAGG and refused is None:
                self.handle_inbound(m, self.protocol.receive_secagg(m.address, m.payload), clocks=clocks)
            elif m.address is None or refused is not None:
                self.handle_inbound(m, refused, clocks=clocks)
            else:
                self._parsing.append(m)
        if self._parsing:
            decoder.submit([m.payload for m in self._parsing])
        if not done:
            return
        spent = time.thread_time()
        built = [_build(self.protocol, parsed, m.payload) for m, (parsed, _) in done]
        spent = time.thread_time() - spent
        parse_total = sum(seconds for _, (_, seconds) in done)
        for (m, (_, seconds)), msg in zip(done, built, strict=True):
            if self.ctl.stop_reason is not None:
                break  # the rest stays unacknowledged: the broker redelivers it to the next session
            share = seconds / parse_total if parse_total > 0.0 else 1.0 / len(done)
            self.handle_inbound(m, msg, seconds + spent * share, clocks)

    def handle_inbound(
        self,
        m: Delivery,
        verdict: Verdict | None = None,
        parse_s: float = 0.0,
        clocks: _Clocks | None = None,
    ) -> None:
        """Handle one inbound message; its acknowledgement waits (without its payload) for the next
        durable point, which comes early when the pending bound is reached. If handling raises, the
        message is rejected and acknowledged with the others (so the broker does not redeliver
        it): no client message stops the server. ``verdict``: the decode worker's (``parse_s``:
        its parsing and building time, charged as it is), or the refusal at admission, when the
        message came through it; ``clocks``: the batch's (None: read now)."""
        self._pending_acks.append((m.ack, len(m.payload)))
        self._pending_bytes += len(m.payload)
        try:
            self._on_inbound(m, verdict, parse_s, clocks or _Clocks.read(self))
        except Exception as exc:  # noqa: BLE001 - any client message is hostile; the loop must survive it
            refused = self.protocol.refuse(
                Refusal.INTERNAL,
                m.address.client if m.address else -1,
                0,
                f"internal error: {type(exc).__name__}",
                f"handling a message on {m.origin[:80]}: {str(exc)[:200]}",
            )
            self._log_refusal(refused, error=True)
        if (
            self._pending_bytes >= self.opts.max_pending_bytes
            or len(self._pending_acks) >= self.opts.max_pending_messages
        ):
            self._checkpoint_due = True

    def _on_inbound(self, m: Delivery, verdict: Verdict | None, parse_s: float, clocks: _Clocks) -> None:
        """The protocol's verdict on one message, carried out: bytes counted, the delivery delay
        noted, a refusal logged, a new message's events handed to the orchestrator."""
        wall = clocks.wall
        if m.address is None:
            got: Received = self.protocol.unaddressed(
                f"transport: message on an unexpected topic {m.origin[:80]!r}"
            )
        elif isinstance(verdict, (Refused, SecAggIn)):
            got = verdict
        elif isinstance(verdict, wire.MessageError) or (
            verdict is not None and not isinstance(verdict, Exception)
        ):  # built from the worker's header (or refused by it): its time is in ``parse_s``
            got = self.protocol.receive_built(m.address, m.payload, verdict, clocks.now)
        elif verdict is not None:
            raise verdict  # building it raised: refused as an internal error, as if raised here
        else:
            spent = time.thread_time()
            got = self.protocol.receive(m.address, m.payload, clocks.now, wall)
            parse_s += time.thread_time() - spent
        sender = got.client if isinstance(got, (Refused, SecAggIn)) else getattr(got.msg, "client", -1)
        self.protocol.charge_decode(sender, parse_s, wall)
        if got.wire_kind is not None:
            self.ctl.count_wire("up", got.wire_kind, len(m.payload))
        if got.msg is not None:
            self.latency.append(max(0.0, clocks.unix - got.msg.sent_at))
            if m.received_at:
                self.inbox_delay.append(wall - m.received_at)
        if isinstance(got, Refused):
            self._log_refusal(got)
        elif isinstance(got, SecAggIn):
            self._on_secagg(got, len(m.payload))
        elif isinstance(got, Duplicate):
            log.debug("duplicate delivery of %s on %s dropped", got.msg.msg_id, m.origin[:80])
        else:
            taken = True
            for event, from_client in got.events:
                taken = self._deliver(event) if from_client else self._deliver(event, from_client=False)
            if taken:
                self.protocol.accepted(got, wall)
            if isinstance(got.msg, wire.Register):
                self._maybe_plan()

    def _on_secagg(self, got: SecAggIn, size: int) -> None:
        """A secure-aggregation message to its group (refused: no group is open outside an
        aggregation, or its checks fail)."""
        assert self.secagg is not None  # the protocol refuses these messages when it is off
        try:
            new = self.secagg.receive(got.client, got.env, got.digest, size)
        except SecAggRefusal as exc:
            reason = f"secagg: {exc.reason.value}"
            self._log_refusal(self.protocol.secagg_refusal(got.client, got.env.task, reason, exc.detail))
            return
        if not new:
            self.stats.duplicates += 1

    def _send_secagg(self, client: int, payload: bytes) -> None:
        self.stats.messages_out += 1
        self.link.send(Channel.TASK, client, payload)
        self.ctl.count_wire("down", "train", len(payload))

    def _pump(self, timeout: float) -> None:
        """Take inbound messages for up to ``timeout`` seconds while a secure aggregation's group
        runs: its messages are handled; the others are charged to their senders' budgets (refused
        at once when over it) and stashed, unacknowledged, for after it, as many as the stash holds;
        the rest stay in the inbox (``felix.deploy.stash``)."""
        fits = self._stash.fits()
        for _, item in self.inbox.get_batch(timeout, INBOX_BATCH, lambda i: _is_secagg(i) or fits(i)):
            if not isinstance(item, Delivery):
                self._stash.push(item)
            elif item.address is None or item.address.channel is Channel.SECAGG:
                self.handle_inbound(item)  # (a message on no known address is only refused)
            else:
                refused = self.protocol.admit(item.address, len(item.payload), self.now(), time.monotonic())
                if refused is not None:
                    self.handle_inbound(item, refused)
                else:
                    self._stash.push(item)

    def _drain_stash(self) -> None:
        """Handle what a secure aggregation held, in arrival order, after what the decode worker
        holds (it came first); an aggregation that it triggers stashes behind it."""
        if self.decoder is not None and self._parsing:
            self._pipeline(self.decoder, [])
        while self._stash and self.ctl.stop_reason is None:
            item = self._stash.pop()
            if isinstance(item, Connected):
                self._on_connected(item)
            elif isinstance(item, Delivery):  # admitted when stashed: parsed here, not admitted again
                spent = time.thread_time()
                try:
                    parsed: wire.Parsed | wire.MessageError = wire.parse(
                        item.payload, self.max_bytes, self.protocol.header_bytes
                    )
                except wire.MessageError as exc:
                    parsed = exc
                built = _build(self.protocol, parsed, item.payload)
                self.handle_inbound(item, built, time.thread_time() - spent)

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

    # ------------------------------------------------------------------ orchestrator
    def _deliver(self, event: Event, from_client: bool = True) -> bool:
        """Hand an event to the orchestrator (through the run controller) and carry out its
        commands; False if it was rejected. ``from_client``: the event is a client's message (its
        modelled bytes count), not one the server derived (a tick, a restart's lost task)."""
        commands = self.ctl.handle(event, from_client)
        if not commands:  # most tier reports: nothing to carry out
            return True
        rejected = any(isinstance(c, UpdateRejected) for c in commands)
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
        out = self.protocol.send(cmd, time.time(), time.monotonic())
        if isinstance(out, Refused):
            self._log_refusal(out)
        elif out is not None:
            self.link.send(out.channel, out.client, out.payload)
            self.ctl.count_wire("down", out.wire_kind, len(out.payload))

    def _publish_status(self, state: str) -> None:
        out = self.protocol.status(state, time.time())
        self.link.send(out.channel, out.client, out.payload)  # STATUS: kept for late joiners

    def _ack(self, items: list[tuple[Ack, int]]) -> None:
        self.link.ack([ack for ack, _ in items])

    # ------------------------------------------------------------------ checkpoints
    def _shell_state(self) -> dict[str, Any]:
        """The shell's part of a checkpoint, explicit and columnar like ``Orchestrator.state_dict``."""
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
            **self.protocol.state_dict(),  # seq_marks, result_digests, incarnations
            **({} if self.freshness is None else {"freshness": self.freshness.state_dict()}),
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
        self.protocol.stats = TransportStats(**shell["stats"])
        self.protocol.load_state_dict(shell)
        if self.freshness is not None:  # a stream run: its curve goes on from the checkpoint
            self.freshness.load_state_dict(shell["freshness"])


def _host_models(h: ModelHosting) -> tuple[ModelStore, ModelServer | None]:
    """The store of a run's models and the built-in server that serves them (none when the
    user's own server serves ``h.folder``); the server is bound here, so its URL is known."""
    if h.port is None:
        assert h.url is not None  # ModelHosting checks it
        return ModelStore(h.url, h.keep, h.folder, in_memory=False), None
    store = ModelStore("", h.keep, h.folder)
    server = ModelServer(store, h)
    store.url_base = h.url or f"http://{h.host}:{server.port}"
    return store, server


def _log_evaluation(row: EvalRow) -> None:
    eps = "" if row.epsilon is None else f", epsilon {row.epsilon:.3g}"
    log.info("version %d at t=%.1fs: accuracy %.4f%s", row.version, row.time_s, row.accuracy, eps)
