"""A run over three Mosquitto brokers (``felix.deploy.shards``) of which one is killed (SIGKILL)
and restarted mid-run: the other shards keep the run going, the killed shard's clients come back,
and every accepted update is applied exactly once; with ``link_process`` the server's links run
in a process of their own (``felix.deploy.link_process``)."""

from __future__ import annotations

import csv
import json
import signal
from pathlib import Path

import pytest
from broker import ShardedBrokers
from mqtt_support import (
    Background,
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    wait_until,
    write_config,
)

from felix.deploy.checkpoint import applied_log_path
from felix.deploy.link import BrokerOptions
from felix.deploy.server import ServeOptions, Server
from felix.deploy.shards import shard_of
from felix.deploy.topics import SERVER_USER

pytestmark = needs_mosquitto
SCALE = 0.04  # 1 config second = 40 ms, as in test_mqtt_e2e
SHARDS = 3
KILLED = 1  # the shard whose broker is killed


def _applied(path: Path) -> list[tuple[int, int]]:
    """(version, client id) of the applied-update log's complete rows so far (the server appends)."""
    out = []
    for line in path.read_text().splitlines()[1:]:
        parts = line.split(",")
        if len(parts) == 6 and parts[0].isdigit() and parts[2].isdigit():
            out.append((int(parts[0]), int(parts[2])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("link_process", [False, True], ids=["one-process", "link-process"])
def test_a_killed_shard_takes_only_its_clients_away_and_nothing_is_applied_twice(
    tmp_path: Path, link_process: bool
) -> None:
    cfg_path = write_config(tmp_path / "cfg.yaml", run={"target_accuracy": 1.0, "max_time_s": 1e6})
    sets = ["--set", "orchestrator.agg_goal=5", "--set", "orchestrator.concurrency=10"]
    cfg = load_config(cfg_path, {"orchestrator": {"agg_goal": 5, "concurrency": 10}})
    n = cfg.partition.num_clients
    on_killed = {c for c in range(n) if shard_of(c, SHARDS) == KILLED}
    assert 0 < len(on_killed) < n
    with ShardedBrokers(n, SHARDS, tmp_path / "brokers", run_id="t") as shards:
        users = json.loads(shards.credentials_file.read_text())
        addresses = BrokerOptions.parse_addresses(shards.address)
        opts = ServeOptions(
            BrokerOptions(
                *addresses[0], SERVER_USER, users[SERVER_USER], reconnect_max_s=1.0, shards=tuple(addresses)
            ),
            run_id="t",
            out_dir=tmp_path / "out",
            checkpoint=tmp_path / "ck.safetensors",
            time_scale=SCALE,
            status_every_s=1e9,
            link_process=link_process,
        )
        server = Server(cfg, opts)
        thread = Background(server.run, "server")
        thread.start()
        emulate = spawn(
            [
                "emulate",
                str(cfg_path),
                *sets,
                "--broker",
                shards.address,
                "--run-id",
                "t",
                "--credentials",
                str(shards.credentials_file),
                "--time-scale",
                str(SCALE),
                "--max-wall-s",
                "120",
                "--clients",
                str(n),
                "--processes",
                "2",
            ],
            tmp_path / "emu.log",
        )
        try:
            wait_until(
                lambda: len(server.orch.clients) == n and server.orch.version >= 3,
                90,
                "every client and 3 versions",
            )
            shards.brokers[KILLED].kill()  # SIGKILL: nothing saved since the last autosave
            killed_at = server.orch.version
            wait_until(
                lambda: not server.link.connections()[KILLED][1], 10, "the server to see the shard down"
            )
            # The other shards' clients keep the run going while one broker is down.
            wait_until(lambda: server.orch.version >= killed_at + 4, 60, "four versions with a shard down")
            assert [up for _, up in server.link.connections()] == [k != KILLED for k in range(SHARDS)]
            shards.brokers[KILLED].start()
            restarted_at = server.orch.version
            wait_until(lambda: server.link.connected, 20, "the server back on the restarted shard")

            log = applied_log_path(opts.checkpoint)

            def killed_shard_applied_since_restart() -> bool:
                return any(v > restarted_at and c in on_killed for v, c in _applied(log))

            wait_until(killed_shard_applied_since_restart, 60, "an update from the restarted shard's clients")
            wait_until(lambda: server.orch.version >= restarted_at + 8, 60, "more versions after the restart")
        finally:
            server.stop_requested.set()
            summ = thread.result(60)
            emulate.send_signal(signal.SIGTERM)
            reap(emulate, timeout=20)

    # Exactly once: every applied update is a distinct task, and the audit trail is complete.
    with open(tmp_path / "out" / "applied_updates.csv") as f:
        rows = list(csv.DictReader(f))
    applied = [int(r["task_id"]) for r in rows]
    assert len(applied) == len(set(applied)) == summ["updates_applied"] > 0
    assert summ["deployment"]["applied_task_ids_unique"]
    assert summ["deployment"]["broker"] == shards.address
    # While the shard was down, the versions came from the other shards' clients only; updates of the
    # killed shard's clients were applied before the kill and after the restart.
    down = [int(r["client_id"]) for r in rows if killed_at + 1 < int(r["version"]) <= restarted_at]
    assert down and not set(down) & on_killed
    assert {int(r["client_id"]) for r in rows if int(r["version"]) > restarted_at} & on_killed
    t = summ["transport"]
    assert t["reconnects"] >= 1, "the server's link to the killed shard reconnected"
    # Duplicates (redeliveries after the restart) are counted, never rejected.
    assert not any("replayed" in reason for reason in summ["rejected_by_reason"]), summ["rejected_by_reason"]
    assert t["registrations"] >= n
