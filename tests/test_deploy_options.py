"""The deployment's start-up options: bad TLS files, trace devices, wall limits and thread counts are
one-line errors naming the option at start-up, never a traceback from the first connection."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from felix.cli import main
from felix.deploy.client import ClientOptions
from felix.deploy.link import BrokerOptions
from felix.deploy.memory_transport import MemoryOptions
from felix.deploy.transport import link_options, resolve


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed (apt-get install openssl): cannot make a test certificate")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls_files_are_loaded_when_the_options_are_made(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    BrokerOptions(tls_ca=str(cert), tls_cert=str(cert), tls_key=str(key))  # a usable set
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases: list[tuple[dict[str, str], str]] = [
        ({"tls_ca": str(tmp_path / "missing.pem")}, "TLS CA file .*missing.pem: No such file"),
        ({"tls_ca": str(garbage)}, "TLS CA file .*garbage.pem: .*NO_CERTIFICATE"),
        (
            {"tls_ca": str(cert), "tls_cert": str(garbage), "tls_key": str(key)},
            "TLS certificate .*garbage.pem",
        ),
        (
            {"tls_ca": str(cert), "tls_cert": str(cert), "tls_key": str(garbage)},
            "TLS certificate .* key .*garbage",
        ),
        ({"tls_ca": str(cert), "tls_cert": str(cert)}, "certificate and its key go together"),
        ({"tls_cert": str(cert), "tls_key": str(key)}, "needs a CA"),
    ]
    for fields, needle in cases:
        with pytest.raises(ValueError, match=needle):
            BrokerOptions(**fields)


def test_client_options_refuse_a_negative_trace_device_or_wall_limit() -> None:
    ClientOptions(BrokerOptions(), "r", trace_device=0, max_wall_s=0.5)
    with pytest.raises(ValueError, match="trace device must be 0 or more, not -3"):
        ClientOptions(BrokerOptions(), "r", trace_device=-3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max wall seconds must be positive"):
            ClientOptions(BrokerOptions(), "r", max_wall_s=bad)


def test_the_client_command_names_its_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["client", "--id", "0", "--username", "u", "--password", "p", "--broker", "127.0.0.1:1"]
    assert main([*base, "--torch-threads", "0"]) == 2
    assert main([*base, "--tls-ca", str(tmp_path / "missing.pem")]) == 2
    err = capsys.readouterr().err
    assert "--torch-threads must be at least 1, not 0" in err and "TLS CA file" in err
    assert "Traceback" not in err


def test_the_server_refuses_a_message_limit_below_one_update_and_folders_it_cannot_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before the broker is contacted (port 1: nothing listens there)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    base = [
        "serve",
        "--username",
        "u",
        "--password",
        "p",
        "--broker",
        "127.0.0.1:1",
        "--out",
        str(tmp_path / "o"),
    ]
    for bad in ("0", "-5", "1000"):
        assert main([*base, "--max-message-bytes", bad]) == 2
    assert main([*base, "--checkpoint", str(a_file / "ck.safetensors")]) == 2
    assert main([*base[:-1], str(a_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("cannot hold one result: its update alone is") == 3
    assert f"checkpoint folder {a_file}: " in err and f"output folder {a_file}: " in err
    assert "Traceback" not in err


def test_a_transport_is_chosen_by_name_and_reads_its_own_options_model() -> None:
    """``--transport NAME`` and ``--link KEY=VALUE`` build the named transport's options model;
    a key it lacks is named (with the nearest one), and a model of another transport is refused."""
    mqtt = link_options("mqtt", {"host": "broker.lan", "port": "1884", "keepalive_s": "30"})
    assert mqtt == BrokerOptions(host="broker.lan", port=1884, keepalive_s=30)
    assert mqtt.describe() == "broker.lan:1884" and not mqtt.secure
    assert mqtt.with_login("u", "p") == BrokerOptions(
        host="broker.lan", port=1884, keepalive_s=30, username="u", password="p"
    )
    memory = link_options("memory", {})
    assert memory == MemoryOptions() and memory.with_login("u", "p") == memory
    with pytest.raises(ValueError, match="transport 'mqtt': option 'prot': unknown key .did you mean `port`"):
        link_options("mqtt", {"prot": "1"})
    with pytest.raises(ValueError, match="transport 'mqtt': option 'port': Input should be a valid integer"):
        link_options("mqtt", {"port": "x"})
    with pytest.raises(
        ValueError, match=r"transport: unknown transport 'carrier-pigeon'; choose one of \['memory', 'mqtt'"
    ):
        link_options("carrier-pigeon", {})
    with pytest.raises(TypeError, match="transport 'memory' takes MemoryOptions, not BrokerOptions"):
        resolve("memory", BrokerOptions())


def test_the_commands_name_a_transports_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["client", "--id", "0", "--transport", "memory", "--broker", "127.0.0.1:1"]) == 2
    assert main(["serve", "--transport", "mqtt", "--link", "keepalive=3"]) == 2
    assert main(["serve", "--link", "keepalive_s"]) == 2
    err = capsys.readouterr().err
    assert "felix client: error: transport 'memory': option 'host': unknown key" in err
    assert (
        "felix serve: error: transport 'mqtt': option 'keepalive': unknown key (did you mean `keepalive_s`?)"
        in err
    )
    assert "--link expects KEY=VALUE, got 'keepalive_s'" in err
    assert "Traceback" not in err
