"""Start and stop a local Mosquitto broker for tests, demos and the capacity benchmark.

The broker listens on 127.0.0.1 only, on a free port, with authentication on (the generated
password file and ACL), and persistence on so that a restart keeps the persistent sessions and
their queued QoS 1 messages (what the broker-restart test exercises). A production broker is
configured by hand from the same pieces; docs/deployment.md lists the settings that matter.
"""

from __future__ import annotations

import getpass
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from felix.deploy import security

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")


class BrokerError(RuntimeError):
    """The broker binary is missing, or it did not start or stop in time."""


def find_mosquitto() -> str | None:
    """The mosquitto binary, or None; tests skip with a clear reason when it is None."""
    for path in MOSQUITTO_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mosquitto")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def raise_open_file_limit() -> None:
    """Lift this process's soft open-file limit to the hard one, for the broker it starts.

    Mosquitto holds one descriptor per connection, and the usual soft limit of 1024 caps a broker
    near 1,000 clients with nothing in its log but refused connections.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY not in (soft, hard) and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def make_test_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a broker certificate for 127.0.0.1 (``openssl``): (ca, cert, key).

    For tests and demos of the TLS option only; a deployment uses certificates of its own PKI.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise BrokerError("openssl is not installed: cannot make test certificates")
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr = folder / "broker.pem", folder / "broker.key", folder / "broker.csr"
    steps = [
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=felix-test-ca",
            "-keyout",
            str(ca_key),
            "-out",
            str(ca),
        ],
        [
            openssl,
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(csr),
        ],
        [
            openssl,
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-days",
            "2",
            "-copy_extensions",
            "copy",
            "-out",
            str(cert),
        ],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            raise BrokerError(f"openssl failed: {done.stderr.decode(errors='replace').strip()}")
    return ca, cert, key


def broker_config(
    port: int,
    password_file: Path,
    acl_file: Path,
    persistence_dir: Path,
    log_file: Path,
    max_message_bytes: int,
    tls: tuple[Path, Path, Path] | None = None,
) -> str:
    """The mosquitto.conf text. The queue and in-flight limits matter for a federated server:

    - ``max_queued_messages``: messages kept for a disconnected persistent session (a server
      restarting, clients offline); Mosquitto's default of 1000 would drop tier reports of a few
      hundred clients during a short server outage.
    - ``max_inflight_messages 0``: the server acknowledges inbound messages only after it has
      checkpointed their effect, so it holds many unacknowledged messages at once.
    - ``set_tcp_nodelay true``: without it, Nagle's algorithm and delayed ACKs hold small
      messages (tier reports, eval results) for up to ~40 ms at each hop.
    - ``autosave_interval 5`` (seconds; ``autosave_on_changes false``): Mosquitto writes its
      persistence database only on a clean shutdown and at autosaves, so a ``kill -9`` loses
      what it acknowledged since the last one. Sessions and subscriptions come back from the
      last autosave; results the broker lost are published again by their clients after they
      reconnect (``felix.deploy.client``) and the server drops the copies it already has;
      a task the broker lost times out on the server and is given to another client.
    """
    tls_lines = [] if tls is None else [f"cafile {tls[0]}", f"certfile {tls[1]}", f"keyfile {tls[2]}"]
    return "\n".join(
        [
            f"listener {port} 127.0.0.1",
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
            "max_inflight_messages 0",
            "set_tcp_nodelay true",
            "max_queued_messages 1000000",
            "max_queued_bytes 0",
            f"max_packet_size {max_message_bytes + 65536}",
            "persistent_client_expiration 1d",
            f"log_dest file {log_file}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "connection_messages false",
            "",
        ]
    )


class MosquittoBroker:
    """A Mosquitto process with generated credentials (and, with ``tls=True``, a TLS listener with
    a throwaway CA). Use as a context manager.

    ``restart()`` stops it gracefully (SIGTERM: Mosquitto writes its persistence database) and
    starts it again on the same port, so clients reconnect to the same address.
    """

    def __init__(
        self,
        num_clients: int,
        run_id: str | None = None,
        workdir: str | Path | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        binary: str | None = None,
        tls: bool = False,
    ) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise BrokerError("mosquitto is not installed (apt-get install mosquitto)")
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="felix-broker-")
        self.dir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.creds = security.generate(self.dir, num_clients, run_id)
        self.port = free_port()
        self.log_file = self.dir / "mosquitto.log"
        self.conf = self.dir / "mosquitto.conf"
        (self.dir / "db").mkdir(exist_ok=True)
        certs = make_test_ca(self.dir) if tls else None
        self.ca_file = certs[0] if certs else None  # clients verify the broker against it (--tls-ca)
        self.conf.write_text(
            broker_config(
                self.port,
                self.creds.password_file,
                self.creds.acl_file,
                self.dir / "db",
                self.log_file,
                max_message_bytes,
                certs,
            )
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def credentials_file(self) -> Path:
        return self.creds.credentials

    def start(self, timeout: float = 10.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        raise_open_file_limit()  # the broker inherits it
        self._proc = subprocess.Popen(
            [self.binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise BrokerError(
                    f"mosquitto exited with code {self._proc.returncode}: {err.strip()}\n{self._log_tail()}"
                )
            if _port_open(self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise BrokerError(
            f"mosquitto did not listen on 127.0.0.1:{self.port} within {timeout} s\n{self._log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        if proc.stderr:
            proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL: a crash, nothing written since the last autosave."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()

    def restart(self, down_s: float = 0.0, crash: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with ``crash``) and start again on the same port."""
        if crash:
            self.kill()
        else:
            self.stop()
        if down_s > 0:
            time.sleep(down_s)
        self.start()

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
