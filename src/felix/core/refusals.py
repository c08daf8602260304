"""Why a message or an update was refused: one closed set from the orchestrator to the wire.

The orchestrator's rejections (:class:`felix.core.commands.UpdateRejected`) carry a kind from
here, the deployment's wire format raises its decoding errors with one, the server protocol
refuses by one and the clients count their drops by one, so every refusal is counted by kind
(``rejected_by_kind`` in ``summary.json``; ``transport.refused_by_kind`` on the server) beside
its reason text (``rejected_by_reason``, which may say more, e.g. which field was wrong).
"""

from __future__ import annotations

from enum import Enum


class Refusal(str, Enum):
    """A refusal's kind; the value is its key in the ``*_by_kind`` counters."""

    # The transport: before a message is decoded.
    TOPIC = "topic"  # not an address the receiver listens on
    RATE_LIMIT = "rate_limit"  # the sender's message budget is spent
    COST_LIMIT = "cost_limit"  # the sender's byte or decode-time budget (per wall second) is spent
    # The wire format's decoding checks (felix.deploy.wire.MessageError.code).
    OVERSIZED = "oversized"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_TYPE = "unknown_type"
    BAD_HEADER = "bad_header"
    BAD_FIELD = "bad_field"
    BAD_PAYLOAD = "bad_payload"
    BAD_AUX = "bad_aux"
    MODEL_HASH = "model_hash"  # a task's model, fetched by hash, is not the bytes the hash names
    # The protocols (server and client): a decoded message checked against what the receiver knows.
    TYPE_ON_TOPIC = "type_on_topic"  # a message type the address does not carry
    OTHER_RUN = "other_run"
    SENDER_MISMATCH = "sender_mismatch"  # the header's client is not the sender's
    WRONG_ADDRESSEE = "wrong_addressee"  # a client got a message addressed to another client
    MESSAGE_ID = "message_id"  # not <incarnation>-<sequence>
    REPLAY = "replay"  # a known message id with other content
    OUTSIDE_POPULATION = "outside_population"
    CLASS_COUNTS = "class_counts"  # a registration's counts do not match the classes or samples
    TOO_MANY_SAMPLES = "too_many_samples"  # a registration claims more than the partition holds
    OLD_INCARNATION = "old_incarnation"  # a tier report of a restarted client's previous process
    WRONG_KIND = "wrong_kind"  # a train result for an eval task, or the reverse
    WRONG_VERSION = "wrong_version"  # computed on another model version than dispatched
    SECAGG = "secagg"  # a secure-aggregation message refused (its typed reason: felix.secagg.refusals)
    # The orchestrator (felix.core.orchestrator and felix.core.validation).
    BAD_REGISTRATION = "bad_registration"  # registered twice, or counts out of range
    UNKNOWN_CLIENT = "unknown_client"  # a tier change or result from a client never registered
    UNKNOWN_TASK = "unknown_task"  # a result for a task never assigned
    TASK_CLOSED = "task_closed"  # a result for a task already applied, cancelled or closed
    NOT_HOLDER = "not_holder"  # a result or failure report for another client's task
    MALFORMED_UPDATE = "malformed_update"  # the update's shape, kind or values are unusable
    INVALID_UPDATE = "invalid_update"  # out of the reported ranges, or screened by its norm or aux
    UNAGGREGATABLE = "unaggregatable"  # the aggregation failed on it (and was rolled back)
    # Either side.
    INTERNAL = "internal"  # handling the message raised


def count_kind(counts: dict[str, int], kind: Refusal) -> None:
    """Count one refusal of ``kind`` in ``counts`` (a closed set: no client can grow it)."""
    counts[kind.value] = counts.get(kind.value, 0) + 1
