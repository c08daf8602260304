"""A message's delay splits at the server's receipt: the transport stamps when it received each
message (``Delivery.received_at``), and the server notes the wait from there to the loop (its
inbox's queue) beside the whole delay from the client's send, so a run that falls behind shows
whether its messages waited in the inbox (the loop is behind) or before the server had them."""

from __future__ import annotations

import time
from pathlib import Path

from mqtt_support import load_config, write_config

from felix.core.types import Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.link import Inbound
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.mqtt_transport import _delivery
from felix.deploy.server import ServeOptions, Server
from felix.deploy.transport import Ack, Delivery


def test_the_mqtt_transport_passes_on_when_it_received_a_message() -> None:
    got = _delivery(Inbound("t", b"x", 7, 1, False, 1, 123.5), lambda _: None, 2)
    assert got.received_at == 123.5 and got.ack.shard == 2


def test_the_server_notes_the_wait_in_its_inbox_apart_from_the_whole_delay(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}, trace={"kind": "always"}),
        {"strategy": "fedbuff", "orchestrator": {"agg_goal": 2, "concurrency": 2}},
    )
    opts = ServeOptions(MemoryOptions(), run_id="r", status_every_s=1e9, transport="memory")
    srv = Server(cfg, opts)
    counts = [0] * srv.num_classes
    counts[0] = srv.partition_sizes[0]
    reg = wire.Register(
        run="r",
        msg_id="i-1",
        sent_at=time.time() - 2.0,  # sent 2 s ago, received by the transport 0.5 s ago
        client=0,
        incarnation="i",
        num_samples=counts[0],
        tier=Tier.AVL_TRAIN,
        class_counts=tuple(counts),
    )
    address = Address(Channel.REGISTER, 0)
    srv.handle_inbound(Delivery(address, wire.encode(reg), Ack(0, 0, 1), "r", time.monotonic() - 0.5))
    state = wire.State(
        run="r", msg_id="i-2", sent_at=time.time(), client=0, incarnation="i", tier=Tier.UN_AVL
    )
    srv.handle_inbound(
        Delivery(Address(Channel.STATE, 0), wire.encode(state), Ack(0, 0, 1), "r")
    )  # unstamped
    assert srv.stats.rejected == 0
    assert len(srv.latency) == 2 and len(srv.inbox_delay) == 1  # a message without a stamp adds no wait
    assert 0.5 <= srv.inbox_delay[0] < 1.5 and srv.latency[0] >= 2.0
    transport = srv.summary(srv.now())["transport"]
    assert 500.0 <= transport["inbox_delay_p50_ms"] < 1500.0
