"""The Mosquitto configuration of a felix deployment, with its limits sized to the run's model.

One text for every broker felix starts or describes: ``felix mqtt-credentials`` writes it next to
the password file and ACL when given the run's config, and the tests' and benchmarks' local broker
(``tests/broker.py``) uses it too. The limits follow from what the server and clients accept:

- ``message_size_limit`` (payload) and ``max_packet_size`` (whole MQTT packet): the server refuses
  any inbound message above ``max_message_bytes`` (by default twice the model in float32 plus
  1 MiB, :func:`default_max_message_bytes`, what a result with a model-sized aux entry needs), and
  a client any task above the same; a broker that forwards 64 MiB would only pass bigger messages
  on to be refused there, after carrying them. The packet limit adds room for the MQTT header
  and topic (``PACKET_OVERHEAD``).
- ``max_inflight_messages``: QoS 1 messages in flight to one connected session. 0 (unbounded)
  let a connected server that fell behind make the broker hold every message for it (2.24 GB
  under a heavy-header flood). Clients get ``CLIENT_INFLIGHT``; the server asks for its own,
  larger window with MQTT 5's Receive Maximum (``SERVER_RECEIVE_MAXIMUM``; Mosquitto 2.0.11
  honours a client's Receive Maximum over this setting), so the server's session holds
  1,000 times a client's in flight before anything of it is queued, let alone dropped.
- ``max_queued_messages`` and ``max_queued_bytes``: what the broker keeps, per session, beyond
  what is in flight: for a disconnected persistent session (the server restarting, a client
  offline) and for a connected one whose window is full. Unbounded (0) would
  let a long server outage grow the broker without limit. The bounds hold every in-flight task's
  result twice over and ``QUEUED_PER_CLIENT`` tier reports per client; beyond them the broker
  drops messages, and the server's task timeout hands the lost work to another client.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CLIENT_INFLIGHT",
    "PACKET_OVERHEAD",
    "QUEUED_PER_CLIENT",
    "SERVER_RECEIVE_MAXIMUM",
    "BrokerLimits",
    "default_max_message_bytes",
    "mosquitto_conf",
]

#: Bytes of MQTT fixed header, topic and properties a packet may carry beyond its payload.
PACKET_OVERHEAD: Final = 64 * 1024
#: QoS 1 messages in flight to a client's connection (a client acknowledges each at once).
CLIENT_INFLIGHT: Final = 20
#: The most the server asks for (MQTT 5's Receive Maximum is a 16-bit count); it asks for twice
#: its pending-acknowledgement bound (``ServeOptions.max_pending_messages``) up to this.
SERVER_RECEIVE_MAXIMUM: Final = 65535
#: Queued messages per client a session may hold during an outage (tier reports, results, tasks).
QUEUED_PER_CLIENT: Final = 100
#: Floor of ``max_queued_bytes``: small models still get room for bursts of small messages.
MIN_QUEUED_BYTES: Final = 64 * 1024 * 1024
#: The payload limit without a model to size it by (the wire format's own default).
UNSIZED_MESSAGE_BYTES: Final = 64 * 1024 * 1024


def default_max_message_bytes(num_params: int) -> int:
    """The largest message the server accepts (and a client) by default: a float32 update plus a
    model-sized aux entry (``8 * num_params``) and 1 MiB for the header and small aux entries."""
    return 8 * num_params + (1 << 20)


@dataclass(frozen=True)
class BrokerLimits:
    """Size limits of the broker: largest payload, and what a disconnected session may queue."""

    max_message_bytes: int
    max_queued_messages: int
    max_queued_bytes: int

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_queued_messages", "max_queued_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (0 means unbounded to Mosquitto)")

    @property
    def max_packet_size(self) -> int:
        return self.max_message_bytes + PACKET_OVERHEAD

    @classmethod
    def for_run(
        cls, num_clients: int, concurrency: int, max_message_bytes: int = UNSIZED_MESSAGE_BYTES
    ) -> BrokerLimits:
        """Limits for ``num_clients`` clients with at most ``concurrency`` tasks in flight, messages
        up to ``max_message_bytes`` (:func:`default_max_message_bytes` of the model)."""
        if num_clients < 1 or concurrency < 1:
            raise ValueError("the number of clients and the concurrency must be at least 1")
        return cls(
            max_message_bytes=max_message_bytes,
            max_queued_messages=max(1000, QUEUED_PER_CLIENT * num_clients),
            max_queued_bytes=max(MIN_QUEUED_BYTES, 2 * concurrency * max_message_bytes),
        )


def mosquitto_conf(
    *,
    listen: tuple[str, int],
    password_file: Path,
    acl_file: Path,
    persistence_dir: Path,
    limits: BrokerLimits,
    log_file: Path | None = None,
    tls: tuple[Path, Path, Path] | None = None,
) -> str:
    """The mosquitto.conf text (docs/deployment.md, "Broker configuration", says why each line).

    Paths are written as given: pass absolute ones for a broker started from another folder.
    ``tls``: (CA, certificate, key) for a TLS listener.
    """
    host, port = listen
    tls_lines = [] if tls is None else [f"cafile {tls[0]}", f"certfile {tls[1]}", f"keyfile {tls[2]}"]
    log_lines = (
        []
        if log_file is None
        else [f"log_dest file {log_file}", "log_type error", "log_type warning", "log_type notice"]
    )
    return "\n".join(
        [
            "# felix-fl broker configuration, generated: see docs/deployment.md, Broker configuration.",
            f"listener {port} {host}",
            *tls_lines,
            # Started as root, Mosquitto would switch to user 'mosquitto', which cannot read our files.
            f"user {getpass.getuser()}",
            "allow_anonymous false",
            # The client id is the login: no client can claim the server's id (or another client's) and
            # take over its session; reconnecting under one's own login disturbs no one else.
            "use_username_as_clientid true",
            f"password_file {password_file}",
            f"acl_file {acl_file}",
            "persistence true",
            f"persistence_location {persistence_dir}/",
            "autosave_interval 5",
            "autosave_on_changes false",
            f"max_inflight_messages {CLIENT_INFLIGHT}",
            "set_tcp_nodelay true",
            f"message_size_limit {limits.max_message_bytes}",
            f"max_packet_size {limits.max_packet_size}",
            f"max_queued_messages {limits.max_queued_messages}",
            f"max_queued_bytes {limits.max_queued_bytes}",
            "persistent_client_expiration 1d",
            *log_lines,
            "connection_messages false",
            "",
        ]
    )
