"""The capacity benchmark's light load generator (benchmarks/mqtt_loadgen.py) against a real broker
and server: its hand-rolled MQTT packets log in, register, report tiers and answer tasks, and the
server accepts all of it as genuine client traffic."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    start_server,
    wait_until,
    write_config,
)

from felix.deploy import wire

LOADGEN = Path(__file__).resolve().parents[1] / "benchmarks" / "mqtt_loadgen.py"

pytestmark = needs_mosquitto


def test_state_template_is_wire_encode_byte_for_byte() -> None:
    sys.path.insert(0, str(LOADGEN.parent))
    from mqtt_loadgen import TIERS, state_payload

    for cid, tier, sent in [(0, TIERS[0], 1764567890.123456), (9999, TIERS[2], 0.1), (17, TIERS[1], 1e-7)]:
        msg = wire.State(
            run="cap-1.x",
            msg_id=f"0a1b2c3d-{cid + 1}",
            sent_at=sent,
            client=cid,
            incarnation="0a1b2c3d",
            tier=tier,
        )
        assert state_payload("cap-1.x", msg.msg_id, sent, cid, "0a1b2c3d", tier) == wire.encode(msg)
        assert wire.decode(state_payload("cap-1.x", msg.msg_id, sent, cid, "0a1b2c3d", tier)) == msg


@pytest.mark.slow
def test_loadgen_registers_reports_tiers_and_answers_tasks(tmp_path: Path) -> None:
    n = 24
    cfg_path = write_config(tmp_path / "c.yaml", trace={"kind": "always"})
    with MosquittoBroker(n, workdir=tmp_path / "broker") as broker:
        server, thread = start_server(load_config(cfg_path), broker, tmp_path / "out", time_scale=0.01)
        gen = subprocess.Popen(
            [
                sys.executable,
                str(LOADGEN),
                str(cfg_path),
                "--broker",
                broker.address,
                "--credentials",
                str(broker.credentials_file),
                "--run-id",
                "t",
                "--clients",
                str(n),
                "--rate",
                "200",
                "--answer",
                "--duration",
                "60",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: len(server.orch.clients) == n, 40, "the load generator's registrations")
            wait_until(
                lambda: server.stats.tier_messages >= 200 and server.orch.version >= 1,
                40,
                "tier reports and answered tasks",
            )
        finally:
            gen.send_signal(signal.SIGTERM)
            out, _ = gen.communicate(timeout=20)
            server.stop_requested.set()
            thread.result(30)
        assert reap(gen) == [0]
    last = json.loads(out.strip().splitlines()[-1])
    assert last["connected"] == n and last["refused"] == 0 and last["lost"] == 0
    assert last["registered"] == n and last["sent_state"] >= 200 and last["sent_result"] >= 10
    assert last["tasks_in"] >= last["sent_result"]
    # Every QoS 1 publish was acknowledged by the broker (the server only sees acknowledged ones).
    assert last["acked"] == last["registered"] + last["sent_state"] + last["sent_result"]
    transport = {k: v for k, v in server.stats.rejected_by_reason.items() if k.startswith("transport")}
    assert transport == {}, transport  # genuine messages: nothing refused at the transport level
    assert server.stats.registrations == n


def test_coalescing_selector_returns_at_most_once_per_tick() -> None:
    """The load generator's event loop wakes at most once per tick: a second wait sleeps out the
    tick (and gathers what arrived meanwhile); a poll (timeout 0) never sleeps."""
    import selectors
    import socket
    import time

    sys.path.insert(0, str(LOADGEN.parent))
    from mqtt_loadgen import CoalescingSelector

    tick = 0.05
    a, b = socket.socketpair()
    with a, b, CoalescingSelector(tick) as sel:
        sel.register(b, selectors.EVENT_READ)
        a.send(b"x")
        t0 = time.monotonic()
        assert len(sel.select(1.0)) == 1 and time.monotonic() - t0 < tick  # the first: at once
        t1 = time.monotonic()
        assert len(sel.select(1.0)) == 1  # still readable, but only a tick after the last
        assert time.monotonic() - t1 >= tick * 0.9
        t2 = time.monotonic()
        sel.select(0)
        assert time.monotonic() - t2 < tick / 2  # a poll does not wait
        b.recv(1)
        t3 = time.monotonic()
        assert sel.select(0.01) == [] and time.monotonic() - t3 < tick  # a timeout inside the tick holds
