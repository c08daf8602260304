"""The MQTT topic scheme of a deployment run (documented in docs/deployment.md).

Every topic lives under ``felix/<run>/`` so one broker can host several runs, and every topic a
client writes ends in its own client id, so the broker's ACL can pin each client to its topics::

    felix/<run>/server/status               server -> all     STATUS (retained): session id, running/finished
    felix/<run>/server/register/<cid>       client -> server  REGISTER: sample and class counts, tier
    felix/<run>/server/state/<cid>          client -> server  STATE: TierTrack tier change (also the will)
    felix/<run>/server/result/<cid>         client -> server  RESULT (train or eval) / FAILED
    felix/<run>/server/secagg/<cid>         client -> server  secure-aggregation stages (keys, shares, ...)
    felix/<run>/client/<cid>/task           server -> client  TRAIN / EVAL / CANCEL / secure-aggregation stages

All messages are published with QoS 1. MQTT does not tell a subscriber who published a message;
identity comes from the broker (username/password plus the ACL, which lets only user
``client-<cid>`` write topics ending in ``/<cid>``) and the server checks that the client id in a
message's header matches the one in its topic. The server protocol and the clients never see a
topic: the MQTT shells map each to its channel and client (``felix.deploy.channels``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from felix.deploy.channels import INBOUND, Address, Channel

RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

SERVER_USER = "felix-server"


def client_user(client_id: int) -> str:
    """The broker username of a client; the ACL is written in terms of it."""
    return f"client-{client_id}"


def check_run_id(run_id: str) -> str:
    """Run ids become topic levels: no '/', '+', '#' or spaces, so a run cannot read another's topics."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    return run_id


def sanitize_run_id(name: str) -> str:
    """Turn a config name into a valid run id (other characters become '-')."""
    out = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:64]
    return out or "run"


_INBOUND = frozenset(ch.value for ch in INBOUND)


@dataclass(frozen=True)
class Topics:
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def root(self) -> str:
        return f"felix/{self.run_id}"

    @property
    def status(self) -> str:
        return f"{self.root}/server/status"

    def register(self, cid: int) -> str:
        return f"{self.root}/server/register/{cid}"

    def state(self, cid: int) -> str:
        return f"{self.root}/server/state/{cid}"

    def result(self, cid: int) -> str:
        return f"{self.root}/server/result/{cid}"

    def secagg(self, cid: int) -> str:
        return f"{self.root}/server/secagg/{cid}"

    def task(self, cid: int) -> str:
        return f"{self.root}/client/{cid}/task"

    def server_subscriptions(self) -> list[str]:
        return [f"{self.root}/server/{ch.value}/+" for ch in INBOUND]

    def to_clients(self, channel: Channel, cid: int | None) -> str:
        """The topic of an outbound message: a client's task topic, or the status topic."""
        if channel is Channel.STATUS:
            return self.status
        assert channel is Channel.TASK and cid is not None, (channel, cid)
        return self.task(cid)

    def client_subscriptions(self, cid: int) -> list[str]:
        return [self.task(cid), self.status]

    def parse_inbound_to_server(self, topic: str) -> Address | None:
        """The channel and client of a topic the server subscribes to, or None if it is not one."""
        prefix = self._server_prefix
        if not topic.startswith(prefix):
            return None
        kind, sep, cid = topic[len(prefix) :].partition("/")
        if not sep or kind not in _INBOUND or not cid.isdigit() or not cid.isascii():
            return None
        return Address(Channel(kind), int(cid))

    @cached_property
    def _server_prefix(self) -> str:
        return f"{self.root}/server/"
