"""The secure-aggregation stages on the deployment's wire: one small envelope around a
:mod:`felix.secagg.messages` payload, so the deployment's addressing (run, client, the task a
message is about) travels beside the protocol's own fields. Layout (little-endian)::

    offset  size  field
    0       4     magic b"FLXS" (a wire-format message starts with b"FLXM")
    4       1     envelope version (1)
    5       1     run id length R (1 to 64)
    6       R     run id (ASCII)
    6+R     4     client id, uint32: the addressee (server -> client) or the sender (client -> server)
    10+R    4     member: the training task the message is about (its id in the group), uint32
    14+R    8     the member's folded aggregation weight in [0, 1], float64 (0 in a client's message)
    22+R    ...   the secure-aggregation message (``felix.secagg.messages.encode``)

Server -> client on the client's task channel (``Setup``, ``KeysBroadcast``, ``SharesForward``,
``UnmaskRequest``); client -> server on its secure-aggregation channel (``Keys``, ``Shares``,
``Masked``, ``Unmask``). :func:`decode` refuses anything that is not exactly one envelope of the
expected direction with ``SecAggRefusal(MALFORMED)``: the run and client checks are the
protocols' (``felix.deploy.protocol``, ``felix.deploy.client_protocol``)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from felix.secagg import messages
from felix.secagg.refusals import Reason, SecAggRefusal

MAGIC = b"FLXS"
VERSION = 1
_HEAD = struct.Struct("<4sBB")
_IDS = struct.Struct("<IIQd")
_FROM_SERVER = (messages.Setup, messages.KeysBroadcast, messages.SharesForward, messages.UnmaskRequest)
_FROM_CLIENT = (messages.Keys, messages.Shares, messages.Masked, messages.Unmask)


@dataclass(frozen=True)
class SecAggEnvelope:
    run: str
    client: int
    member: int
    task: int
    weight: float
    msg: messages.Message


def is_secagg(payload: bytes) -> bool:
    """Whether ``payload`` claims to be an envelope (a client tells it from a task by its magic)."""
    return payload[:4] == MAGIC


def encode(env: SecAggEnvelope) -> bytes:
    run = env.run.encode("ascii")
    return (
        _HEAD.pack(MAGIC, VERSION, len(run))
        + run
        + _IDS.pack(env.client, env.member, env.task, env.weight)
        + messages.encode(env.msg)
    )


def decode(raw: bytes, from_server: bool) -> SecAggEnvelope:
    """The envelope in ``raw``, sent by the server (``from_server``) or by a client."""
    if len(raw) < _HEAD.size:
        raise SecAggRefusal(Reason.MALFORMED, "an envelope shorter than its header")
    magic, version, n = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise SecAggRefusal(Reason.MALFORMED, "not a secure-aggregation envelope of this version")
    if not 1 <= n <= 64 or len(raw) < _HEAD.size + n + _IDS.size:
        raise SecAggRefusal(Reason.MALFORMED, "an envelope shorter than its run id and ids")
    run_raw = raw[_HEAD.size : _HEAD.size + n]
    if not run_raw.isascii() or not run_raw.decode().isprintable():
        raise SecAggRefusal(Reason.MALFORMED, "a run id that is not printable ASCII")
    client, member, task, weight = _IDS.unpack_from(raw, _HEAD.size + n)
    if not math.isfinite(weight) or not 0.0 <= weight <= 1.0 or (not from_server and weight != 0.0):
        raise SecAggRefusal(Reason.MALFORMED, f"a weight of {weight!r}")
    msg = messages.decode(raw[_HEAD.size + n + _IDS.size :])
    want = _FROM_SERVER if from_server else _FROM_CLIENT
    if not isinstance(msg, want):
        raise SecAggRefusal(
            Reason.WRONG_STAGE, f"a {type(msg).__name__} from the {'server' if from_server else 'client'}"
        )
    if not from_server and msg.sender != member:
        raise SecAggRefusal(Reason.NOT_MEMBER, f"a message of member {msg.sender} in an envelope of {member}")
    if from_server and msg.sender != messages.SERVER:
        raise SecAggRefusal(Reason.MALFORMED, "a server message with a client's sender id")
    return SecAggEnvelope(run_raw.decode(), client, member, task, weight, msg)


__all__ = ["MAGIC", "SecAggEnvelope", "decode", "encode", "is_secagg"]
