"""The deployment's client side of the wire protocol as a sans-I/O object: bytes from the server
and the channel they came on in, a message to act on or a typed drop out.

The server's messages are checked like a client's are on the server (``felix.deploy.protocol``):
the wire format, the run, the message types the channel carries and, for a task or a cancel, that
it is addressed to this client. What fails is dropped, counted by kind (the same closed set,
:class:`felix.core.refusals.Refusal`) and described for the log; nothing else here needs a socket,
a thread or a clock, so tests drive it with hostile payloads alone. The client processes
(``felix.deploy.client``) keep the task queues, the timers and the links.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from felix.core.refusals import Refusal, count_kind
from felix.deploy import secagg_wire, wire
from felix.deploy.channels import ALLOWED, Channel
from felix.secagg.refusals import SecAggRefusal

ToClient = wire.Status | wire.TrainTask | wire.EvalTask | wire.Cancel | secagg_wire.SecAggEnvelope


@dataclass(frozen=True)
class Dropped:
    """A message from the server a client will not act on: why (counted) and a detail for the log
    (not counted: it may quote what was received)."""

    kind: Refusal
    detail: str


@dataclass
class ClientProtocol:
    """The checks of the server's messages for the clients of one process (run ``run_id``; messages
    up to ``max_bytes``), and the count of what they dropped, by kind."""

    run_id: str
    max_bytes: int
    dropped_by_kind: dict[str, int] = field(default_factory=dict)

    def receive(self, client: int, channel: Channel, payload: bytes) -> ToClient | Dropped:
        """Check one message that reached ``client`` on ``channel`` (task or status): a
        secure-aggregation stage travels on the task channel in its own envelope."""
        if channel is Channel.TASK and secagg_wire.is_secagg(payload):
            return self._secagg(client, payload)
        try:
            msg = wire.decode(payload, self.max_bytes)
        except wire.MessageError as exc:
            return self._drop(exc.code, f"a malformed message on its {channel.value} channel: {exc}")
        if msg.run != self.run_id:
            return self._drop(Refusal.OTHER_RUN, f"a message for run {msg.run!r}")
        if msg.TYPE not in ALLOWED[channel]:
            return self._drop(
                Refusal.TYPE_ON_TOPIC, f"a {msg.TYPE.value} message on its {channel.value} channel"
            )
        if isinstance(msg, wire.Status):
            return msg
        assert isinstance(msg, (wire.TrainTask, wire.EvalTask, wire.Cancel))  # ALLOWED[TASK] holds no other
        if msg.client != client:
            return self._drop(
                Refusal.WRONG_ADDRESSEE, f"a {msg.TYPE.value} message addressed to client {msg.client}"
            )
        return msg

    def complete(self, client: int, payload: bytes, body: bytes) -> wire.TrainTask | wire.EvalTask | Dropped:
        """A task that named its model by hash (``receive`` passed it), decoded again with the
        model's fetched bytes ``body``: bytes of another hash or size are dropped (``model_hash``)."""
        try:
            msg = wire.decode(payload, self.max_bytes, model_body=body)
        except wire.MessageError as exc:
            return self._drop(exc.code, f"task's model: {exc}")
        assert isinstance(msg, (wire.TrainTask, wire.EvalTask)) and msg.client == client  # receive checked
        return msg

    def _secagg(self, client: int, payload: bytes) -> secagg_wire.SecAggEnvelope | Dropped:
        if len(payload) > self.max_bytes:
            return self._drop(Refusal.OVERSIZED, f"a secure-aggregation message of {len(payload)} bytes")
        try:
            env = secagg_wire.decode(payload, from_server=True)
        except SecAggRefusal as exc:
            return self._drop(Refusal.SECAGG, f"a secure-aggregation message: {exc}")
        if env.run != self.run_id:
            return self._drop(Refusal.OTHER_RUN, f"a secure-aggregation message for run {env.run!r}")
        if env.client != client:
            return self._drop(
                Refusal.WRONG_ADDRESSEE, f"a secure-aggregation message addressed to client {env.client}"
            )
        return env

    def refused(self, exc: SecAggRefusal) -> Dropped:
        """Count a secure-aggregation message the client's state machine refused."""
        return self._drop(Refusal.SECAGG, f"a secure-aggregation message: {exc}")

    def _drop(self, kind: Refusal, detail: str) -> Dropped:
        count_kind(self.dropped_by_kind, kind)
        return Dropped(kind, detail)
