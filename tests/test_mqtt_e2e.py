"""End to end over a real Mosquitto on 127.0.0.1: a server and 24 clients under trace-driven churn
train digits to the target, while four clients are killed mid-task (and restarted) and the broker
is killed with SIGKILL (kill -9) and restarted once. Every accepted update must be applied exactly
once; with ``link_process`` the server's link runs in a process of its own
(``felix.deploy.link_process``)."""

from __future__ import annotations

import csv
import json
import re
import signal
import time
from pathlib import Path

import pytest
from broker import MosquittoBroker
from mqtt_support import (
    load_config,
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    reap,
    spawn,
    start_server,
    wait_until,
    write_config,
)

pytestmark = needs_mosquitto
SCALE = 0.04  # 1 config second = 40 ms: 10 s tasks take 0.4 s, a 60 s trace slot 2.4 s, the timeout 3.6 s
KILLED = [20, 21, 22, 23]


@pytest.mark.slow
@pytest.mark.parametrize("link_process", [False, True], ids=["one-process", "link-process"])
def test_churn_kills_and_broker_restart(tmp_path: Path, link_process: bool) -> None:
    cfg_path = write_config(tmp_path / "cfg.yaml")
    sets = {"orchestrator": {"agg_goal": 5, "concurrency": 10}}
    cfg = load_config(cfg_path, sets)
    set_args = ["--set", "orchestrator.agg_goal=5", "--set", "orchestrator.concurrency=10"]
    with MosquittoBroker(cfg.partition.num_clients, workdir=tmp_path / "broker") as broker:
        common = [
            str(cfg_path),
            "--broker",
            broker.address,
            "--run-id",
            "t",
            "--credentials",
            str(broker.credentials_file),
            "--time-scale",
            str(SCALE),
            "--max-wall-s",
            "90",
            *set_args,
        ]
        t0 = repr(time.time())
        emulate = spawn(
            ["emulate", *common, "--clients", "20", "--processes", "1", "--t0", t0], tmp_path / "emu.log"
        )
        doomed = spawn(["client", *common, "--ids", "20-23", "--t0", t0], tmp_path / "doomed.log")
        reborn = None
        server, thread = start_server(
            cfg, broker, tmp_path / "out", SCALE, tmp_path / "ck.safetensors", link_process=link_process
        )
        try:
            clients = server.orch.clients
            wait_until(
                lambda: all(c in clients for c in KILLED) and server.orch.version >= 2,
                60,  # a loaded 2-core machine needs more than 40 s here
                "the doomed clients to register and two versions",
            )
            wait_until(
                lambda: any(clients[c].in_flight is not None for c in KILLED),
                20,
                "a task in flight on a doomed client",
            )
            held = {clients[c].in_flight for c in KILLED} - {None}
            doomed.send_signal(signal.SIGKILL)  # no clean disconnect: the broker sends their wills
            reap(doomed)
            killed_at = server.orch.version
            reborn = spawn(["client", *common, "--ids", "20-23", "--t0", t0], tmp_path / "reborn.log")
            wait_until(lambda: server.orch.version >= killed_at + 3, 30, "three more versions after the kill")
            broker.restart(down_s=0.5, crash=True)  # kill -9: nothing saved since the last autosave
            restarted_at = server.orch.version
            summ = thread.result(60)
        finally:
            server.stop_requested.set()
            codes = reap(*[p for p in (emulate, reborn, doomed) if p is not None], timeout=20)
    assert summ["stop_reason"] == "target_reached", summ
    assert summ["final_accuracy"] >= 0.7 and summ["aggregations"] > restarted_at > killed_at
    assert codes[:2] == [0, 0], "the clients exit once the server announces the end of the run"

    # Exactly once: every applied update is a distinct task, and the audit trail is complete.
    with open(tmp_path / "out" / "applied_updates.csv") as f:
        applied = [int(r["task_id"]) for r in csv.DictReader(f)]
    assert len(applied) == len(set(applied)) == summ["updates_applied"]
    assert summ["deployment"]["applied_task_ids_unique"]

    t = summ["transport"]
    assert t["reconnects"] >= 1, "the server reconnected after the broker restart"
    # The killed processes took their tasks with them: none of those was ever applied, except one
    # whose result they sent before the kill (on its way then, it may be applied, once: checked
    # above); their log says which they sent. (Whether the restarted processes rejoin before the
    # target is a race with the run, so it is not asserted.)
    sent = {
        int(t)
        for t in re.findall(r"client \d+: task (\d+): result sent", (tmp_path / "doomed.log").read_text())
    }
    unsent = held - sent
    assert unsent and not unsent & set(applied), (held, sent)
    assert t["tier_messages"] > 0 and t["registrations"] >= 24
    # Duplicates (redeliveries after the restart) are counted, never rejected.
    assert not any("replayed" in reason for reason in summ["rejected_by_reason"]), summ["rejected_by_reason"]
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk["transport"]["duplicates"] == t["duplicates"]
    assert (tmp_path / "out" / "evaluations.csv").exists()
    assert summ["virtual_time_s"] > summ["wall_time_s"]  # config seconds: the time scale is applied
    assert summ["bytes_by_kind"]["up"]["train"] > 0 and summ["bytes_by_kind"]["up"]["control"] > 0


@pytest.mark.parametrize("bad", ["wrong-password", "unknown-user"])
def test_bad_login_is_refused_with_a_clear_error(tmp_path: Path, bad: str) -> None:
    from felix.deploy.link import BrokerOptions, LinkError, MqttLink

    with MosquittoBroker(2, workdir=tmp_path / "broker") as broker:
        user = "client-0" if bad == "wrong-password" else "mallory"
        link = MqttLink(
            "x",
            BrokerOptions("127.0.0.1", broker.port, user, "nope", connect_timeout_s=10),
            [],
            lambda item: None,
        )
        with pytest.raises(LinkError, match="refused"):
            link.start(fresh=True)


def test_tls_option(tmp_path: Path) -> None:
    """--tls-ca: the broker is verified against the CA and the session is encrypted; plain TCP fails."""
    import shutil

    from mqtt_support import users

    from felix.deploy.link import BrokerOptions, Connected, Inbound, LinkError, MqttLink

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (apt-get install openssl): cannot make test certificates")
    with MosquittoBroker(1, workdir=tmp_path / "broker", tls=True) as broker:
        u = users(broker)
        got: list[Inbound | Connected] = []
        opts = BrokerOptions(
            "127.0.0.1",
            broker.port,
            "felix-server",
            u["felix-server"],
            tls_ca=str(broker.ca_file),
            connect_timeout_s=10,
        )
        server = MqttLink("srv", opts, ["felix/t/server/result/+"], got.append)
        server.start(fresh=True)
        client = MqttLink(
            "c0",
            BrokerOptions(**{**opts.__dict__, "username": "client-0", "password": u["client-0"]}),
            [],
            got.append,
        )
        client.start(fresh=True)
        client.publish("felix/t/server/result/0", b"over tls")
        wait_until(
            lambda: any(isinstance(m, Inbound) and m.payload == b"over tls" for m in got), 10, "the message"
        )
        client.close()
        server.close()
        plain = MqttLink(
            "c1",
            BrokerOptions("127.0.0.1", broker.port, "client-0", u["client-0"], connect_timeout_s=3),
            [],
            got.append,
        )
        with pytest.raises(LinkError):
            plain.start(fresh=True)
