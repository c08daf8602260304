"""Review finding 3 of issue 11: the server's inbox (paho thread -> loop) is bounded.

A flood must meet back-pressure before it exhausts memory: the network thread's ``put`` waits
while the bound is reached, and ``close`` (at shutdown) releases it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mqtt_support import load_config, write_config

from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions, Connected, Inbound
from felix.deploy.server import ServeOptions, Server

MB = 1 << 20


def inbound(n: int, size: int = MB) -> Inbound:
    return Inbound("t/result/0", bytes(size), n, 1, False, 0, time.monotonic())


def flood(put, n: int) -> threading.Thread:
    def run() -> None:
        for i in range(n):
            put(inbound(i))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_server_inbox_blocks_a_flood_at_its_bound(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(tmp_path / "cfg.yaml", partition={"num_clients": 2}), {"strategy": "fedbuff"}
    )
    server = Server(cfg, ServeOptions(BrokerOptions("127.0.0.1", 1), run_id="t", max_inbox_bytes=4 * MB))
    th = flood(server.inbox.put, 64)  # what paho's network thread does under a 64 MB flood
    th.join(1.0)
    assert th.is_alive(), "64 MB went into the inbox without back-pressure"
    queued = 0
    while (item := server.inbox.get(timeout=0.5)) is not None:  # the loop drains it; the flood completes
        assert isinstance(item, Inbound)
        queued += 1
    th.join(5.0)
    assert not th.is_alive() and queued == 64


def test_inbox_bounds_bytes_and_count_and_close_releases_a_blocked_put() -> None:
    box = Inbox(max_bytes=3 * MB, max_messages=1000)
    th = flood(box.put, 10)
    time.sleep(0.3)
    assert th.is_alive() and len(box) == 3 and box.queued_bytes == 3 * MB and box.full_waits == 1
    box.put(Connected(1, False))  # a connection notice is never held back
    assert len(box) == 4
    box.close()
    th.join(2.0)
    assert not th.is_alive() and box.dropped >= 1
    counted = Inbox(max_bytes=1 << 30, max_messages=2)
    th = flood(counted.put, 3)
    time.sleep(0.3)
    assert th.is_alive() and len(counted) == 2
    assert counted.get(0.1) is not None
    th.join(2.0)
    assert not th.is_alive() and len(counted) == 2
    big = Inbox(max_bytes=MB // 2, max_messages=10)
    big.put(inbound(0))  # larger than the bound, into an empty inbox: admitted, nothing deadlocks
    assert len(big) == 1 and big.get(0.1) is not None and big.get(0.05) is None
