"""How the deployment's two ends address each other, whatever carries the bytes.

A message travels on a channel, and an inbound one comes from a client: the server protocol
(``felix.deploy.protocol``) and the clients are addressed by ``(channel, client id)``, never by a
transport's own addressing. Each transport maps these to its own (the MQTT topics of
``felix.deploy.topics``) and vouches for the sender the way it can (MQTT: the broker's ACL pins a
login to the topics ending in its client id).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from felix.deploy.wire import MsgType


class Channel(str, Enum):
    REGISTER = "register"  # client -> server
    STATE = "state"  # client -> server: TierTrack tier changes (and the MQTT will)
    RESULT = "result"  # client -> server: results and failure reports
    SECAGG = "secagg"  # client -> server: secure-aggregation stages (felix.deploy.secagg_wire)
    TASK = "task"  # server -> one client
    STATUS = "status"  # server -> every client, kept for late joiners (MQTT: retained)


INBOUND = (
    Channel.REGISTER,
    Channel.STATE,
    Channel.RESULT,
    Channel.SECAGG,
)  # the channels the server listens on

# Which message types each channel carries; anything else on it is refused. The secure-aggregation
# channel carries no message of the wire format: its payloads are felix.deploy.secagg_wire's.
ALLOWED: dict[Channel, frozenset[MsgType]] = {
    Channel.REGISTER: frozenset({MsgType.REGISTER}),
    Channel.STATE: frozenset({MsgType.STATE}),
    Channel.RESULT: frozenset({MsgType.RESULT, MsgType.FAILED}),
    Channel.SECAGG: frozenset(),
    Channel.TASK: frozenset({MsgType.TRAIN, MsgType.EVAL, MsgType.CANCEL}),
    Channel.STATUS: frozenset({MsgType.STATUS}),
}


@dataclass(frozen=True)
class Address:
    """Where an inbound message came from, as its transport vouches: the channel and the client."""

    channel: Channel
    client: int
