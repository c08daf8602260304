"""The generated Mosquitto configuration: limits sized to the model, queues bounded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from broker import find_mosquitto, free_port

from felix.deploy.broker_config import (
    MIN_QUEUED_BYTES,
    PACKET_OVERHEAD,
    BrokerLimits,
    default_max_message_bytes,
    mosquitto_conf,
)
from felix.deploy.cli import main as deploy_main


def _settings(text: str) -> dict[str, str]:
    pairs = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def test_limits_follow_the_model_and_bound_the_queues() -> None:
    limits = BrokerLimits.for_run(100, 30, default_max_message_bytes(6090))
    assert limits.max_message_bytes == 8 * 6090 + (1 << 20)  # what the server accepts, about 1.1 MB
    assert limits.max_packet_size == limits.max_message_bytes + PACKET_OVERHEAD
    assert limits.max_queued_messages == 10_000
    assert limits.max_queued_bytes == MIN_QUEUED_BYTES
    big = BrokerLimits.for_run(100, 30, default_max_message_bytes(537_000))
    assert big.max_queued_bytes == 2 * 30 * big.max_message_bytes
    with pytest.raises(ValueError, match="0 means unbounded"):
        BrokerLimits(max_message_bytes=1, max_queued_messages=1, max_queued_bytes=0)


def test_mqtt_credentials_writes_a_conf_sized_to_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "broker"
    code = deploy_main(
        ["mqtt-credentials", "--preset", "felix", "--set", "partition.num_clients=5", "--out", str(out)]
    )
    assert code == 0
    assert "sized to 6,090 parameters" in capsys.readouterr().err
    conf = _settings((out / "mosquitto.conf").read_text())
    assert conf["message_size_limit"] == str(8 * 6090 + (1 << 20))
    assert conf["max_packet_size"] == str(8 * 6090 + (1 << 20) + PACKET_OVERHEAD)
    assert conf["max_queued_messages"] == "1000" and conf["max_queued_bytes"] == str(MIN_QUEUED_BYTES)
    assert conf["listener"] == "1883 127.0.0.1"
    assert conf["password_file"] == str((out / "passwd").resolve())
    assert (out / "db").is_dir()
    # Without a config: the wire format's 64 MiB, said so; an explicit size wins.
    code = deploy_main(["mqtt-credentials", "--clients", "3", "--out", str(out), "--listen", "0.0.0.0:8883"])
    assert code == 0 and "not sized to a model" in capsys.readouterr().err
    assert _settings((out / "mosquitto.conf").read_text())["message_size_limit"] == str(64 << 20)
    code = deploy_main(["mqtt-credentials", "--clients", "3", "--out", str(out), "--max-message-bytes", "0"])
    assert code == 2 and "max_message_bytes must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(
    find_mosquitto() is None, reason="mosquitto broker not installed (apt-get install mosquitto)"
)
def test_mosquitto_accepts_the_generated_conf(tmp_path: Path) -> None:
    """Mosquitto 2 parses every line (an unknown or misspelt option would stop it at once)."""
    (tmp_path / "passwd").write_text("")
    (tmp_path / "acl").write_text("")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(
        mosquitto_conf(
            listen=("127.0.0.1", port),
            password_file=tmp_path / "passwd",
            acl_file=tmp_path / "acl",
            persistence_dir=tmp_path,
            limits=BrokerLimits.for_run(10, 5, default_max_message_bytes(1000)),
            log_file=tmp_path / "log",
        )
    )
    binary = find_mosquitto()
    assert binary is not None
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.5)  # still running: the configuration was accepted
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert b"Error" not in err, err
