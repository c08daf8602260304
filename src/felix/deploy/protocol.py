"""The deployment's server protocol as a sans-I/O object: bytes and their sender's address in,
events or a typed refusal out; commands in, an address and bytes out.

Everything the server decides about a client's message before the orchestrator sees it lives
here, beside no socket, thread or clock: the channel, the sender's message budget, the wire format
(``felix.deploy.wire``), the run id, that the header's client is the topic's, duplicates and
replays, the population's bounds, registrations (class counts, sample bounds, incarnations: a
client that restarted loses the tasks it held) and tier reports of a previous incarnation. A
result's kind and model version travel in its ``TaskFinished`` event, and the orchestrator's task
ledger checks them against the task it answers (the one record of dispatched tasks). Time is passed in (config seconds),
so tests drive it with hostile payloads alone, and the MQTT server (``felix.deploy.server``) is
left with the link, the threads, the clock and the checkpoints.

Refusals are one closed set (:class:`felix.core.refusals.Refusal`, shared with the wire format
and the orchestrator, whose rejections keep their kind here), counted by kind; each also keeps the
reason text the summary's ``rejected_by_reason`` has always counted.

Duplicates are recognised by what a message is about, not by remembering every message id: a
result by its task id (the result that closed a task is remembered by digest, a bounded number of
them), a REGISTER or STATE by its sender's sequence number (message ids are
``<incarnation>-<sequence>``; one watermark per client and id prefix, a few prefixes per client).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from felix.core.admission import TokenBuckets
from felix.core.commands import CancelTask, Command, DispatchEval, DispatchTrain, UpdateRejected
from felix.core.events import ClientRegistered, Event, TaskFailed, TaskFinished, TierChanged
from felix.core.orchestrator import Orchestrator
from felix.core.refusals import Refusal, count_kind
from felix.core.types import TaskKind
from felix.deploy import secagg_wire, wire
from felix.deploy.channels import ALLOWED, Address, Channel
from felix.deploy.download_budget import DownloadBudget
from felix.metrics.report import tally_rejection
from felix.secagg.refusals import SecAggRefusal

SEQ_PREFIXES_PER_CLIENT = 4  # message-id prefixes (incarnations, wills) whose sequence watermark is kept
RESULT_DIGESTS = 65536  # results remembered by task id (digest) to tell a redelivery from a replay


@dataclass(frozen=True)
class Refused:
    """A refused message: its kind, the sender (-1: none known) and task (0: none), the reason text
    counted under ``rejected_by_reason`` and a detail for the log (not counted: it may quote what
    a client sent)."""

    kind: Refusal
    client: int
    task: int
    reason: str
    detail: str = ""
    msg: wire.Message | None = None  # the decoded message, if it was decoded
    wire_kind: str | None = None  # the byte account it counts under (None: not counted)


@dataclass(frozen=True)
class Duplicate:
    """A redelivery of a message already handled (QoS 1 is at least once): dropped."""

    msg: wire.Message
    wire_kind: str


@dataclass(frozen=True)
class Accepted:
    """A new message: the events to hand to the orchestrator, in order, each with whether it is the
    client's own (its modelled bytes count) or derived by the server (a restarted client's lost
    task). Call :meth:`ServerProtocol.accepted` once the orchestrator took them all."""

    msg: wire.Message
    wire_kind: str
    events: tuple[tuple[Event, bool], ...]
    digest: bytes | None = None  # a result's, remembered once the orchestrator accepted it


@dataclass(frozen=True)
class SecAggIn:
    """A secure-aggregation message whose envelope passed (run, sender, format): the shell's
    group driver (``felix.deploy.secagg_groups``) checks its group, member and stage."""

    client: int
    env: secagg_wire.SecAggEnvelope
    digest: bytes  # of the payload: a verbatim redelivery is a duplicate, not a replay
    wire_kind: str = "train"  # the protocol's messages are training traffic (as the simulator counts them)
    msg: None = None  # (no wire-format message: no send time to take the delivery delay from)


Received = Accepted | Duplicate | Refused | SecAggIn


@dataclass(frozen=True)
class Outbound:
    """A message to send: its channel and client (None: every client), payload and byte account
    (train, eval, control)."""

    channel: Channel
    client: int | None
    payload: bytes
    wire_kind: str


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
    refused_by_kind: dict[str, int] = field(default_factory=dict)


class Orchestration(Protocol):
    """What the protocol reads of the orchestrator: who registered, what a client holds, its
    data-plan row (a registration may count the rows it was planned to add)."""

    @property
    def plans(self) -> Mapping[int, tuple[int, ...]]: ...

    def is_registered(self, cid: int) -> bool: ...

    def held_task(self, cid: int) -> int | None: ...

    def late_task(self, cid: int) -> int | None: ...


class LiveOrchestration:
    """An orchestrator as the protocol reads it (:class:`Orchestration`); the policies' view of
    it is another thing, ``felix.core.view.OrchestratorView``."""

    def __init__(self, orch: Orchestrator) -> None:
        self._orch = orch

    @property
    def plans(self) -> Mapping[int, tuple[int, ...]]:
        return self._orch.plans

    def is_registered(self, cid: int) -> bool:
        return cid in self._orch.clients

    def held_task(self, cid: int) -> int | None:
        return self._orch.clients[cid].in_flight

    def late_task(self, cid: int) -> int | None:
        return self._orch.late_task(cid)


@dataclass(frozen=True)
class ProtocolLimits:
    """The bounds the protocol checks: the population, each client's most samples, the largest
    message, the aux entries the objective and aggregator declare, and the per-client message
    budget (``rate`` per config second up to ``burst``; None: no budget)."""

    num_clients: int
    num_classes: int
    partition_sizes: list[int]
    max_bytes: int
    aux_spec: Mapping[str, Any]
    rate: float | None = None
    burst: float = 50.0
    # The cost budget, per login and per wall second (a server's CPU and bandwidth are spent in
    # wall time, whatever the time scale): decode seconds (a share of one core) and payload bytes.
    # None: off.
    cpu_share: float | None = None
    cpu_burst_s: float = 0.25
    bytes_per_s: float | None = None
    bytes_burst: float = 0.0  # (at least one largest message)
    # Secure aggregation on: a training result carries no update (it travels masked, through the
    # secure-aggregation channel) and stands for a zero delta of this length in the ledger and
    # the buffer; one that carries its update in the clear is refused. None: off.
    sealed_length: int | None = None


@dataclass(frozen=True)
class CostBudget:
    """Per login (ids outside the population share key -1), in wall seconds: the decode time
    and the payload bytes its messages may cost the server. A message is refused unread while
    either bucket is in debt; its bytes are charged before decoding, its decode time after."""

    cpu: TokenBuckets | None
    bytes: TokenBuckets | None

    @classmethod
    def of(cls, lim: ProtocolLimits) -> CostBudget:
        cpu = None if lim.cpu_share is None else TokenBuckets(lim.cpu_share, lim.cpu_burst_s)
        burst = max(lim.bytes_burst, float(lim.max_bytes))
        b = None if lim.bytes_per_s is None else TokenBuckets(lim.bytes_per_s, burst)
        return cls(cpu, b)

    def admit(self, key: int, size: int, wall: float) -> str | None:
        """What is spent, if the message may not be read now; else None (its bytes are charged)."""
        if self.cpu is not None and not self.cpu.take(key, wall, 0.0):
            return "decode time"
        if self.bytes is not None and not self.bytes.take(key, wall, float(size)):
            return "bytes"
        return None


def digest(msg_id: str, payload: bytes) -> bytes:
    """16 bytes: 8 of the message id, 8 of the payload (a replay keeps the id, changes the rest)."""
    return (
        hashlib.blake2b(msg_id.encode(), digest_size=8).digest()
        + hashlib.blake2b(payload, digest_size=8).digest()
    )


def _wire_kind(msg: wire.Message) -> str:
    return msg.kind.value if isinstance(msg, wire.Result) else "control"


class ServerProtocol:
    """The server's side of the wire protocol for run ``run_id``: :meth:`receive` and
    :meth:`send`, with the state they keep (sequence watermarks, result digests, incarnations)
    and its part of a checkpoint (:meth:`state_dict`)."""

    def __init__(self, run_id: str, session: str, limits: ProtocolLimits, orch: Orchestration) -> None:
        self.run_id = run_id
        self.session = session
        self.limits = limits
        self.orch = orch
        self.ids = wire.MsgIds(f"s{session}")
        self.stats = TransportStats()
        # Each client's message budget (ids outside the population share one: key -1).
        self.buckets = None if limits.rate is None else TokenBuckets(limits.rate, limits.burst)
        self.cost = CostBudget.of(limits)
        self.header_bytes = wire.header_limit(limits.num_classes)
        self.seq_marks: dict[int, dict[str, int]] = {}  # client -> message-id prefix -> highest sequence
        self.result_digests: dict[int, bytes] = {}  # task id -> digest of the result that closed it
        self.incarnations: dict[int, str] = {}
        # Set (felix.deploy.model_store.ModelStore.ref): tasks name their model by hash instead of carrying it.
        self.models: Callable[[np.ndarray, dict[str, np.ndarray]], wire.ModelRef] | None = None
        self._zeros: np.ndarray | None = None
        # Set (the MQTT server): what a login is sent and leaves unanswered is bounded by what it sent.
        self.downloads: DownloadBudget | None = None

    # ------------------------------------------------------------------ inbound
    def receive(self, source: Address, payload: bytes, now: float, wall: float = 0.0) -> Received:
        """Check one inbound message from ``source`` (as its transport vouches) at config time
        ``now`` (``wall``: the server's wall clock in seconds, for the cost budget); refusals are
        counted here. The caller charges the decode time with :meth:`charge_decode`.

        It is :meth:`admit`, ``wire.parse`` and :meth:`receive_parsed` in turn; a server with a
        decode worker (``felix.deploy.decode_worker``) runs the middle step in that process."""
        refused = self.admit(source, len(payload), now, wall)
        if refused is not None:
            return refused
        if source.channel is Channel.SECAGG:
            return self.receive_secagg(source, payload)
        try:
            parsed: wire.Parsed | wire.MessageError = wire.parse(
                payload, self.limits.max_bytes, self.header_bytes
            )
        except wire.MessageError as exc:
            parsed = exc
        return self.receive_parsed(source, payload, parsed, now)

    def admit(self, source: Address, size: int, now: float, wall: float) -> Refused | None:
        """Count an inbound message of ``size`` bytes and refuse it unread (None: it may be
        decoded) while its sender's message or cost budget is spent."""
        self.stats.messages_in += 1
        kind, cid = source.channel, source.client
        key = self.budget_key(cid)
        # Before decoding: a flood, or heavy headers, cost the server a topic parse and a counter.
        if self.buckets is not None and not self.buckets.take(key, now):
            return self.refuse(
                Refusal.RATE_LIMIT, cid, 0, f"transport: rate limit ({kind.value})", wire_kind="control"
            )
        spent = self.cost.admit(key, size, wall)
        if spent is not None:
            return self.refuse(
                Refusal.COST_LIMIT, cid, 0, f"transport: cost limit ({spent})", wire_kind="control"
            )
        if self.downloads is not None and key >= 0:
            self.downloads.received(cid, size, wall)
        return None

    def receive_parsed(
        self, source: Address, payload: bytes, parsed: wire.Parsed | wire.MessageError, now: float
    ) -> Received:
        """The rest of :meth:`receive` for an admitted message whose header ``wire.parse`` checked
        (or refused: the error it raised): :meth:`build`, then :meth:`receive_built`."""
        return self.receive_built(source, payload, self.build(parsed, payload), now)

    def build(
        self, parsed: wire.Parsed | wire.MessageError, payload: bytes
    ) -> wire.Message | wire.MessageError:
        """The message a checked header describes, on ``payload``'s bytes, with the aux entries
        checked against the run's (``wire.build``), or the error that refuses it. It reads no
        state of the protocol's, so the server builds a decode worker's batch in one pass."""
        if isinstance(parsed, wire.MessageError):
            return parsed
        try:
            return wire.build(parsed, payload, self.limits.aux_spec)
        except wire.MessageError as exc:
            return exc

    def receive_built(
        self, source: Address, payload: bytes, built: wire.Message | wire.MessageError, now: float
    ) -> Received:
        """The rest of :meth:`receive_parsed` for a message :meth:`build` made (or refused): the
        checks that read the protocol's and the orchestrator's state, and the verdict."""
        kind, cid = source.channel, source.client
        lim = self.limits
        if isinstance(built, wire.MessageError):
            return self.refuse(
                built.code,
                cid,
                0,
                f"transport: {built.code.value}",
                built.detail,
                wire_kind="control",
            )
        msg = built
        wk = _wire_kind(msg)
        if msg.TYPE not in ALLOWED[kind]:
            return self.refuse(
                Refusal.TYPE_ON_TOPIC,
                cid,
                0,
                f"transport: {msg.TYPE.value} message on a {kind.value} topic",
                msg=msg,
            )
        if msg.run != self.run_id:
            return self.refuse(Refusal.OTHER_RUN, cid, 0, f"transport: message for run {msg.run!r}", msg=msg)
        sender = getattr(msg, "client", None)
        if sender != cid:
            return self.refuse(
                Refusal.SENDER_MISMATCH,
                cid,
                getattr(msg, "task", 0),
                f"transport: sender mismatch: header says client {sender}, topic belongs to client {cid}",
                msg=msg,
            )
        seen = self._first_delivery(cid, msg, payload)
        if seen is not None:
            return seen
        if cid >= lim.num_clients:
            return self.refuse(
                Refusal.OUTSIDE_POPULATION,
                cid,
                0,
                f"transport: client id {cid} is outside the population of {lim.num_clients}",
                msg=msg,
            )
        if isinstance(msg, wire.Register):
            return self._on_register(msg, now)
        if isinstance(msg, wire.State):
            return self._on_state(msg, now)
        if isinstance(msg, wire.Result):
            return self._on_result(msg, payload, now)
        assert isinstance(msg, wire.Failed)  # ALLOWED leaves no other type on a result topic
        return Accepted(
            msg, wk, ((TaskFailed(now, cid, msg.task, msg.reason), True),), digest(msg.msg_id, payload)
        )

    def receive_secagg(self, source: Address, payload: bytes) -> SecAggIn | Refused:
        """Check an admitted secure-aggregation message's envelope: its format, run and sender
        (the group, member and stage are the group driver's to check)."""
        cid = source.client
        if self.limits.sealed_length is None:
            return self.secagg_refusal(cid, 0, "secagg: secure aggregation is off in this run")
        if len(payload) > self.limits.max_bytes:
            return self.refuse(
                Refusal.OVERSIZED, cid, 0, "transport: oversized", f"{len(payload)} bytes", wire_kind="train"
            )
        try:
            env = secagg_wire.decode(payload, from_server=False)
        except SecAggRefusal as exc:
            return self.secagg_refusal(cid, 0, f"secagg: {exc.reason.value}", exc.detail)
        if env.run != self.run_id:
            return self.refuse(
                Refusal.OTHER_RUN,
                cid,
                env.task,
                f"transport: message for run {env.run!r}",
                wire_kind="train",
            )
        if env.client != cid:
            return self.refuse(
                Refusal.SENDER_MISMATCH,
                cid,
                env.task,
                f"transport: sender mismatch: envelope says client {env.client}, topic belongs to client {cid}",
                wire_kind="train",
            )
        if cid >= self.limits.num_clients:
            return self.refuse(
                Refusal.OUTSIDE_POPULATION,
                cid,
                0,
                f"transport: client id {cid} is outside the population of {self.limits.num_clients}",
                wire_kind="train",
            )
        return SecAggIn(cid, env, hashlib.blake2b(payload, digest_size=16).digest())

    def secagg_refusal(self, cid: int, member: int, reason: str, detail: str = "") -> Refused:
        """Count a refused secure-aggregation message (``reason``: ``secagg: <typed reason>``)."""
        return self.refuse(Refusal.SECAGG, cid, member, reason, detail, wire_kind="train")

    def unaddressed(self, reason: str) -> Refused:
        """Count a message that came on no address the server listens on (``reason`` says where)."""
        self.stats.messages_in += 1
        return self.refuse(Refusal.TOPIC, -1, 0, reason)

    def budget_key(self, cid: int) -> int:
        """The budget a sender spends: its own, or the one ids outside the population share."""
        return cid if 0 <= cid < self.limits.num_clients else -1

    def charge_decode(self, cid: int, seconds: float, wall: float) -> None:
        """Charge ``seconds`` of the server's time handling a message of ``cid`` to its budget."""
        if self.cost.cpu is not None:
            self.cost.cpu.spend(self.budget_key(cid), wall, seconds)

    def refuse(
        self,
        kind: Refusal,
        cid: int,
        task: int,
        reason: str,
        detail: str = "",
        msg: wire.Message | None = None,
        wire_kind: str | None = None,
    ) -> Refused:
        """Count a refusal (by kind, and by its reason text) and describe it."""
        self.stats.rejected += 1
        count_kind(self.stats.refused_by_kind, kind)
        tally_rejection(self.stats.rejected_by_reason, reason)
        if msg is not None and wire_kind is None:
            wire_kind = _wire_kind(msg)
        return Refused(kind, cid, task, reason, detail, msg, wire_kind)

    def accepted(self, received: Accepted, wall: float = 0.0) -> None:
        """The orchestrator took ``received``'s events: a result's or failure's task is closed, and
        a redelivery of the same message is from now on a duplicate (``wall``: the server's wall
        clock, for the download budget, which refunds an answered task)."""
        msg = received.msg
        if received.digest is None or not isinstance(msg, (wire.Result, wire.Failed)):
            return
        if self.downloads is not None:
            self.downloads.closed(msg.client, msg.task, isinstance(msg, wire.Result), wall)
        self.result_digests[msg.task] = received.digest
        if len(self.result_digests) > RESULT_DIGESTS:
            for t in list(self.result_digests)[: RESULT_DIGESTS // 2]:
                del self.result_digests[t]

    def _first_delivery(self, cid: int, msg: wire.Message, payload: bytes) -> Duplicate | Refused | None:
        """None if the message is new (or a replay the orchestrator will refuse), else the verdict.

        Results and failure reports are about a task: the result that closed a task is kept by
        digest (message id and content), so a verbatim redelivery is a duplicate and the same
        id with other content a replay; any other message for a closed task reaches the
        orchestrator, which refuses it. REGISTER and STATE carry ``<prefix>-<sequence>`` ids
        that grow per sender: anything at or below the prefix's watermark was seen already.
        """
        if isinstance(msg, (wire.Result, wire.Failed)):
            prior = self.result_digests.get(msg.task)
            if prior is None:
                return None
            d = digest(msg.msg_id, payload)
            if prior == d:
                self.stats.duplicates += 1
                return Duplicate(msg, _wire_kind(msg))
            if prior[:8] == d[:8]:
                return self.refuse(
                    Refusal.REPLAY,
                    cid,
                    msg.task,
                    "transport: replayed message id with different content",
                    msg=msg,
                )
            return None
        prefix, sep, seq = msg.msg_id.rpartition("-")
        if not sep or not seq.isdigit() or len(seq) > 18:
            return self.refuse(
                Refusal.MESSAGE_ID, cid, 0, "transport: message id is not <incarnation>-<sequence>", msg=msg
            )
        marks = self.seq_marks.setdefault(cid, {})
        n = int(seq)
        if n <= marks.get(prefix, -1):
            self.stats.duplicates += 1
            return Duplicate(msg, "control")
        marks.pop(prefix, None)
        marks[prefix] = n  # most recently used last
        if len(marks) > SEQ_PREFIXES_PER_CLIENT:
            del marks[next(iter(marks))]
        return None

    def _on_register(self, msg: wire.Register, now: float) -> Received:
        cid = msg.client
        self.stats.registrations += 1
        counts = msg.class_counts
        classes = self.limits.num_classes
        if len(counts) != classes or sum(counts) != msg.num_samples:
            return self.refuse(
                Refusal.CLASS_COUNTS,
                cid,
                0,
                "transport: registration's class counts do not match the classes or the samples",
                f"{len(counts)} counts summing to {sum(counts)} for {msg.num_samples} samples, {classes} classes",
                msg=msg,
            )
        # After augmenting a client holds its partition plus its row of the data plan.
        most = self.limits.partition_sizes[cid] + sum(self.orch.plans.get(cid, ()))
        if msg.num_samples > most:
            return self.refuse(
                Refusal.TOO_MANY_SAMPLES,
                cid,
                0,
                "transport: registration claims more samples than the client's partition holds",
                f"{msg.num_samples} > {most}",
                msg=msg,
            )
        if not self.orch.is_registered(cid):
            self.incarnations[cid] = msg.incarnation
            return Accepted(
                msg, "control", ((ClientRegistered(now, cid, msg.num_samples, msg.tier, counts), True),)
            )
        # A known client registers again: the server restarted (same incarnation) or the client did
        # (new incarnation), in which case the task it held is gone with its process.
        self.stats.re_registrations += 1
        events: list[tuple[Event, bool]] = []
        if self.incarnations.get(cid) != msg.incarnation:
            self.stats.client_restarts += 1
            self.incarnations[cid] = msg.incarnation
            held = self.orch.held_task(cid)
            if held is not None:
                events.append((TaskFailed(now, cid, held, "client restarted"), False))
            late = self.orch.late_task(cid)  # a task it lost the slot of: no late reply will come either
            if late is not None:
                events.append((TaskFailed(now, cid, late, "client restarted"), False))
        events.append((TierChanged(now, cid, msg.tier), True))
        return Accepted(msg, "control", tuple(events))

    def _on_state(self, msg: wire.State, now: float) -> Received:
        self.stats.tier_messages += 1
        known = self.incarnations.get(msg.client)
        if known is not None and known != msg.incarnation:
            # e.g. the will of a process that has since been restarted: its tier is not the client's.
            return self.refuse(
                Refusal.OLD_INCARNATION,
                msg.client,
                0,
                "transport: tier report from a previous client incarnation",
                msg=msg,
            )
        return Accepted(msg, "control", ((TierChanged(now, msg.client, msg.tier), True),))

    def _on_result(self, msg: wire.Result, payload: bytes, now: float) -> Received:
        self.stats.results += 1
        update = msg.update
        if self.limits.sealed_length is not None and msg.kind is TaskKind.TRAIN:
            if not msg.sealed:
                return self.secagg_refusal(
                    msg.client, msg.task, "secagg: a training result that carries its update in the clear"
                )
            update = dataclasses.replace(update, delta=self._sealed_delta())
        elif msg.sealed:
            return self.secagg_refusal(msg.client, msg.task, "secagg: secure aggregation is off in this run")
        # Its kind and version travel in the event: the orchestrator's ledger checks them.
        event = TaskFinished(now, msg.client, msg.task, update, msg.kind, msg.version)
        return Accepted(msg, msg.kind.value, ((event, True),), digest(msg.msg_id, payload))

    def _sealed_delta(self) -> np.ndarray:
        """The zero delta a sealed training result stands for (one read-only array for all)."""
        if self._zeros is None:
            assert self.limits.sealed_length is not None
            self._zeros = np.zeros(self.limits.sealed_length, dtype=np.float32)
            self._zeros.flags.writeable = False
        return self._zeros

    # ------------------------------------------------------------------ outbound
    def send(self, cmd: Command, sent_at: float, wall: float = 0.0) -> Outbound | Refused | None:
        """The message that carries out ``cmd`` (``sent_at``: Unix time, the wire's stamp; ``wall``:
        the server's wall clock, for the download budget), or the counted refusal of an update the
        orchestrator rejected; None for a command the wire does not carry (a new model version)."""
        if isinstance(cmd, DispatchTrain):
            task = wire.TrainTask(
                **self._env(sent_at),
                client=cmd.client_id,
                task=cmd.task_id,
                version=cmd.version,
                plan=cmd.plan,
                weights=cmd.weights,
                aux=cmd.aux,
                model=None if self.models is None else self.models(cmd.weights, cmd.aux),
            )
            return self._task_out(cmd.client_id, cmd.task_id, task, "train", wall)
        if isinstance(cmd, DispatchEval):
            probe = wire.EvalTask(
                **self._env(sent_at),
                client=cmd.client_id,
                task=cmd.task_id,
                version=cmd.version,
                weights=cmd.weights,
                model=None if self.models is None else self.models(cmd.weights, {}),
            )
            return self._task_out(cmd.client_id, cmd.task_id, probe, "eval", wall)
        if isinstance(cmd, CancelTask):
            msg = wire.Cancel(**self._env(sent_at), client=cmd.client_id, task=cmd.task_id, reason=cmd.reason)
            out = self._out(cmd.client_id, msg, "control")
            if self.downloads is not None:
                self.downloads.closed(cmd.client_id, cmd.task_id, False, wall)
                self.downloads.sent(cmd.client_id, -1, len(out.payload), None, 0, wall)
            return out
        if isinstance(cmd, UpdateRejected):
            return self.refuse(cmd.kind, cmd.client_id, cmd.task_id, cmd.reason)
        return None

    def status(self, state: str, sent_at: float) -> Outbound:
        """The retained STATUS: this server session is up (``running``) or the run is over."""
        msg = wire.Status(**self._env(sent_at), session=self.session, state=state)
        return Outbound(Channel.STATUS, None, wire.encode(msg), "control")

    def _env(self, sent_at: float) -> dict[str, Any]:
        return {"run": self.run_id, "msg_id": self.ids.next(), "sent_at": sent_at}

    def _task_out(
        self, cid: int, task: int, msg: wire.TrainTask | wire.EvalTask, kind: str, wall: float
    ) -> Outbound:
        out = self._out(cid, msg, kind)
        if self.downloads is not None:
            ref = msg.model
            sha, size = (None, 0) if ref is None else (ref.sha256, ref.size)
            self.downloads.sent(cid, task, len(out.payload), sha, size, wall)
        return out

    def _out(self, cid: int, msg: wire.Message, kind: str) -> Outbound:
        self.stats.messages_out += 1
        return Outbound(Channel.TASK, cid, wire.encode(msg), kind)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The protocol's part of a checkpoint, explicit and columnar like ``Orchestrator.state_dict``."""
        marks = [(c, p, n) for c, m in self.seq_marks.items() for p, n in m.items()]
        digests = self.result_digests
        return {
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys. A checkpoint written before the orchestrator's ledger
        checked a result's kind and version also holds ``shadow`` (the protocol's own copy of the
        dispatched tasks); it is ignored: the ledger's open tasks say the same."""
        sm = state["seq_marks"]
        self.seq_marks = {}
        for c, p, n in zip(sm["client"].tolist(), sm["prefix"], sm["seq"].tolist(), strict=True):
            self.seq_marks.setdefault(c, {})[p] = n
        rd = state["result_digests"]
        flat = rd["digest"].tobytes()
        self.result_digests = {t: flat[16 * i : 16 * (i + 1)] for i, t in enumerate(rd["task"].tolist())}
        inc = state["incarnations"]
        self.incarnations = dict(zip(inc["client"].tolist(), inc["incarnation"], strict=True))
