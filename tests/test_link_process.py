"""The server's link in a process of its own (``felix.deploy.link_process``) against a real Mosquitto
on 127.0.0.1: a start that cannot connect fails as in one process, a full inbox longer than the
keep-alive costs no connection, a child that stops answering or dies fails the link (and ends
``felix serve`` with one line and a non-zero exit) within a bound, and ``close`` is bounded.
The end-to-end runs through it are ``test_mqtt_e2e`` and ``test_mqtt_shards``, parametrized."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from broker import MosquittoBroker, free_port
from mqtt_support import (
    needs_mosquitto,
    one_torch_thread,  # noqa: F401  (a fixture)
    users,
    wait_until,
    write_config,
)

from felix.deploy.inbox import Inbox
from felix.deploy.link import BrokerOptions, LinkError
from felix.deploy.link_process import LinkProcess
from felix.deploy.mqtt_transport import MqttServerLink
from felix.deploy.topics import SERVER_USER
from felix.deploy.transport import Connected, Delivery, ServerLinkArgs

pytestmark = needs_mosquitto
N = 300
SIZE = 10_000  # 3 MB in all: more than the pipe (1 MiB), the child's buffer and the inbox hold


def _link(opts: BrokerOptions, box: Inbox, **kw: object) -> LinkProcess:
    return LinkProcess("mqtt", ServerLinkArgs("t", opts, 1000, box.put, box.put_many), **kw)  # type: ignore[arg-type]


def _server_opts(broker: MosquittoBroker, **kw: object) -> BrokerOptions:
    return BrokerOptions("127.0.0.1", broker.port, SERVER_USER, users(broker)[SERVER_USER], **kw)  # type: ignore[arg-type]


def test_a_start_without_a_broker_fails_as_in_one_process_within_the_connect_timeout() -> None:
    opts = BrokerOptions("127.0.0.1", free_port(), connect_timeout_s=2.0)
    box = Inbox(1 << 20, 100)
    with pytest.raises(LinkError) as direct:
        MqttServerLink(ServerLinkArgs("t", opts, 1000, box.put, box.put_many)).start(fresh=True)
    link = _link(opts, box)
    t0 = time.monotonic()
    with pytest.raises(LinkError) as child:
        link.start(fresh=True)
    assert time.monotonic() - t0 < 2.0 + 5.0  # the connect timeout, and the child's start-up
    assert str(child.value) == str(direct.value) and "cannot reach the broker" in str(child.value)
    assert link.proc.poll() is not None, "a failed start leaves no process behind"


def test_the_in_memory_transport_is_refused_in_one_line() -> None:
    from felix.deploy.memory_transport import MemoryOptions

    box = Inbox(1 << 20, 100)
    with pytest.raises(ValueError, match="in-memory transport cannot run in a link process"):
        LinkProcess("memory", ServerLinkArgs("t", MemoryOptions(), None, box.put, box.put_many))


def test_a_full_inbox_longer_than_the_keepalive_costs_no_connection(tmp_path: Path) -> None:
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        # Keep-alive 2 s: the broker drops a connection silent for 3 s, so the 8 s below are more
        # than twice that.
        opts = _server_opts(broker, keepalive_s=2, connect_timeout_s=10)
        box = Inbox(1 << 20, 20)
        link = _link(opts, box, timeout_s=3.0)
        link.start(fresh=True)
        wait_until(link.ready, 10, "the subscriptions")
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="client-0", protocol=mqtt.MQTTv5)
        pub.username_pw_set("client-0", users(broker)["client-0"])
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        try:
            infos = [
                pub.publish("felix/t/server/state/0", b"m%04d" % i + bytes(SIZE), qos=1) for i in range(N)
            ]
            for info in infos:
                info.wait_for_publish(10)
            # The owner is behind: its inbox stays full for 8 s, and with it the pipe and so the
            # network thread's hand-over.
            time.sleep(8.0)
            link.ready()  # the state's own pipe kept the heartbeat going: not taken for a silent child
            got: list[Delivery] = []
            notices: list[Connected] = []
            deadline = time.monotonic() + 30
            while len(got) < N and time.monotonic() < deadline:
                batch = [m for _, m in box.get_batch(0.5, 100)]
                notices += [m for m in batch if isinstance(m, Connected)]
                msgs = [m for m in batch if isinstance(m, Delivery)]
                link.ack([m.ack for m in msgs])
                got += msgs
            time.sleep(2.0)  # a connection the broker dropped is found dead once its bytes are read
            late = [m for _, m in box.get_batch(0.5, 1000)]
            got += [m for m in late if isinstance(m, Delivery)]
            notices += [m for m in late if isinstance(m, Connected)]
            assert link.connected and [c.epoch for c in notices] == [1], (
                "reconnected while the inbox was full"
            )
            assert [m.payload[:5] for m in got] == [b"m%04d" % i for i in range(N)]  # each once, in order
            assert {m.ack.epoch for m in got} == {1}
            assert box.full_waits >= 1
        finally:
            pub.disconnect()
            pub.loop_stop()
            link.close()


def test_a_silent_child_fails_the_link_and_close_kills_it_within_a_bound(tmp_path: Path) -> None:
    with MosquittoBroker(1, workdir=tmp_path / "broker") as broker:
        box = Inbox(1 << 20, 100)
        link = _link(_server_opts(broker, connect_timeout_s=10), box, timeout_s=2.0)
        link.start(fresh=True)
        wait_until(link.ready, 10, "the subscriptions")
        os.kill(link.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
        try:
            t0 = time.monotonic()
            with pytest.raises(LinkError, match="did not answer within 2 s"):
                while time.monotonic() - t0 < 10.0:
                    link.ready()
                    time.sleep(0.05)
            assert time.monotonic() - t0 < 5.0
            with pytest.raises(LinkError):
                link.send(link_channel(), 0, b"x")
            t1 = time.monotonic()
            link.close(timeout=1.0)
            assert time.monotonic() - t1 < 5.0 and link.proc.poll() is not None
        finally:
            if link.proc.poll() is None:
                link.proc.kill()


def link_channel() -> object:
    from felix.deploy.channels import Channel

    return Channel.TASK


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == pid and b"felix.deploy.link_process" in cmd:
                out.append(int(p.name))
    return out


@pytest.mark.parametrize("how", ["child killed", "SIGTERM"])
def test_felix_serve_with_a_link_process_ends_within_a_bound(tmp_path: Path, how: str) -> None:
    """A link process killed mid-run ends ``felix serve`` with one line and exit code 2; SIGTERM
    stops it cleanly (exit 130, interrupted, its summary written) and takes the link process with it."""
    cfg_path = write_config(tmp_path / "cfg.yaml")
    with MosquittoBroker(4, workdir=tmp_path / "broker") as broker:
        cmd = [
            *(sys.executable, "-m", "felix.deploy", "serve", str(cfg_path)),
            *("--broker", broker.address, "--run-id", "t", "--password", users(broker)[SERVER_USER]),
            *("--out", str(tmp_path / "out"), "--link-process", "--decode-worker"),
        ]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: bool(_children(proc.pid)), 30, "the link process")
            (child,) = _children(proc.pid)
            time.sleep(3.0)  # connected and serving
            assert proc.poll() is None
            t0 = time.monotonic()
            if how == "child killed":
                os.kill(child, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
            assert time.monotonic() - t0 < 15.0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if how == "child killed":
            assert proc.returncode == 2, err
            assert "felix serve: error: the link process is gone (exit code -9)" in err.splitlines()[-1], err
        else:
            assert proc.returncode == 130 and "(interrupted)" in err.splitlines()[-1], err
            assert (tmp_path / "out" / "summary.json").exists()
            assert not Path(f"/proc/{child}").exists() or b"Z" in Path(f"/proc/{child}/stat").read_bytes()
