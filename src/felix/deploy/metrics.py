"""Prometheus metrics of a running ``felix serve`` (``--metrics-port``), read at scrape time.

An operator watches a deployment with the tools it already has: the server exposes the Prometheus
text format over HTTP through ``prometheus-client``. Nothing is counted twice: the collector
(:class:`ServerCollector`) keeps no state of its own and reads, when Prometheus scrapes, the
counters and state the server already keeps for ``summary.json`` (the orchestrator's client map,
task ledger and counters, the wire protocol's refusals, the admission rules' counters, the inbox).
A message handled costs the metrics nothing; a scrape costs one pass over the open tasks and one
count of the registered clients' tier column.

The endpoint cannot stall the server: prometheus-client's HTTP server runs in threads of its own,
and the collector only copies (each copy of a dict or list is one step under the interpreter's lock)
and never waits for the loop thread. The loop thread may change what is read between two
reads, so one scrape's families are each consistent but not a snapshot of one instant; a dict that
changes size while copied makes the collector read again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Self

import numpy as np
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from felix.core.types import TaskKind, TaskState, Tier
from felix.deploy.shards import shards_of

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from felix.deploy.server import Server

log = logging.getLogger("felix.deploy.metrics")

READ_ATTEMPTS = 3  # reads of the live state before a scrape gives up on a family set


class MetricsError(ValueError):
    """The metrics endpoint cannot start (a bad address or port): a one-line error for the CLI."""


def _counters(prefix: str, doc: str, stats: object) -> Iterator[Metric]:
    """One counter per integer field of a counters dataclass (``TransportStats``,
    ``AdmissionStats``, ``OrchestratorStats``): a field added there is exported with no change here."""
    for f in fields(stats):  # type: ignore[arg-type]
        value = getattr(stats, f.name)
        if isinstance(value, int) and not isinstance(value, bool):
            yield CounterMetricFamily(f"{prefix}_{f.name}", f"{doc}: {f.name}", value=value)


def _labelled(name: str, doc: str, label: str, counts: dict[str, int]) -> Metric:
    m = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(dict(counts).items()):  # dict(): one step, however the loop thread writes
        m.add_metric([key], n)
    return m


class ServerCollector(Collector):
    """The server's live state as Prometheus families (see ``docs/deployment.md``, "Metrics")."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterable[Metric]:
        for attempt in range(READ_ATTEMPTS):
            try:
                return list(self._read())
            except RuntimeError:  # a dict or deque changed size while it was read: read again
                if attempt == READ_ATTEMPTS - 1:
                    raise
        return []

    def _read(self) -> Iterator[Metric]:
        s = self.server
        o = s.orch
        info = GaugeMetricFamily(
            "felix_run_info", "the run served (value 1)", labels=["run_id", "strategy", "session"]
        )
        info.add_metric([s.opts.run_id, s.cfg.strategy, s.session], 1)
        yield info
        yield GaugeMetricFamily("felix_model_version", "the current model version", value=o.version)
        yield CounterMetricFamily(
            "felix_model_versions",
            "model versions made (aggregations; a resumed run counts on from its checkpoint): "
            "rate() is versions per second",
            value=o.version,
        )
        yield GaugeMetricFamily(
            "felix_virtual_time_seconds", "the run's clock (config seconds)", value=s.now()
        )

        tiers = np.bincount(o.clients.column("tier"), minlength=len(Tier))
        by_tier = GaugeMetricFamily("felix_clients", "registered clients by tier", labels=["tier"])
        for t in Tier:
            by_tier.add_metric([t.name], int(tiers[t.value]))
        yield by_tier
        yield GaugeMetricFamily("felix_clients_registered", "registered clients", value=int(tiers.sum()))

        open_tasks = {(k, st): 0 for k in TaskKind for st in TaskState}
        for task in o.tasks():  # a copy of the ledger's open tasks
            open_tasks[task.kind, task.state] += 1
        tasks = GaugeMetricFamily("felix_tasks", "open tasks by kind and state", labels=["kind", "state"])
        for (kind, state), n in open_tasks.items():
            if state not in (TaskState.DONE, TaskState.CANCELLED):  # closed tasks are not open
                tasks.add_metric([kind.value, state.value], n)
        yield tasks
        yield from _counters("felix_orchestrator", "orchestrator counter", o.stats)

        stats = s.stats
        yield _labelled(
            "felix_refusals", "messages refused by the wire protocol, by kind", "kind", stats.refused_by_kind
        )
        yield _labelled(
            "felix_rejections",
            "messages rejected, by reason (numbers as N)",
            "reason",
            stats.rejected_by_reason,
        )
        yield from _counters("felix_transport", "transport counter", stats)
        yield from _counters("felix_admission", "admission counter", o.admission.stats)
        if s.protocol.downloads is not None:  # the per-login download budget (felix serve --download-ratio)
            yield from _counters(
                "felix_download_budget", "download budget counter", s.protocol.downloads.stats
            )

        inbox = s.inbox
        yield GaugeMetricFamily(
            "felix_inbox_messages", "messages received, not yet handled", value=len(inbox)
        )
        yield GaugeMetricFamily(
            "felix_inbox_bytes", "payload bytes received, not yet handled", value=inbox.queued_bytes
        )
        yield GaugeMetricFamily(
            "felix_inbox_max_messages", "the inbox's message bound", value=inbox.max_messages
        )
        yield GaugeMetricFamily("felix_inbox_max_bytes", "the inbox's byte bound", value=inbox.max_bytes)
        yield CounterMetricFamily(
            "felix_inbox_full_waits",
            "receptions that waited for room in a full inbox",
            value=inbox.full_waits,
        )

        connections = s.link.connections()  # one per broker shard, in shard order
        connected = GaugeMetricFamily(
            "felix_broker_connected",
            "the server's connection to each broker shard (1 up, 0 down)",
            labels=["shard", "broker"],
        )
        for k, (broker, up) in enumerate(connections):
            connected.add_metric([str(k), broker], 1 if up else 0)
        yield connected
        shard_clients = GaugeMetricFamily(
            "felix_broker_clients",
            "registered clients served through each broker shard",
            labels=["shard", "broker"],
        )
        per_shard = np.bincount(shards_of(o.clients.ids, len(connections)), minlength=len(connections))
        for k, (broker, _) in enumerate(connections):
            shard_clients.add_metric([str(k), broker], int(per_shard[k]))
        yield shard_clients


class MetricsEndpoint:
    """``--metrics-port``: prometheus-client's HTTP server in a thread of its own, with a registry
    that holds only :class:`ServerCollector`. ``port`` 0 takes a free port (``self.port``)."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0) -> None:
        if not (0 <= port <= 65535):
            raise MetricsError(f"metrics port {port} is outside 0-65535")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServerCollector(server))
        try:
            self._httpd: WSGIServer = start_http_server(port, host, registry)[0]
        except OSError as exc:  # in use, not permitted, an address not on this machine
            raise MetricsError(f"metrics endpoint {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port = int(self._httpd.server_address[1])
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
