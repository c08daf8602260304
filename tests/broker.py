"""Start and stop a local Mosquitto broker for tests, demos and the capacity benchmark.

The broker listens on 127.0.0.1 only, on a free port, with authentication on (the generated
password file and ACL), and persistence on so that a restart keeps the persistent sessions and
their queued QoS 1 messages (what the broker-restart test exercises). Its configuration is the
package's (``felix.deploy.broker_config``, what ``felix mqtt-credentials`` writes for a
deployment); docs/deployment.md lists the settings that matter.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Self

from felix.deploy import security
from felix.deploy.broker_config import BrokerLimits, mosquitto_conf

#: Messages a session may queue in tests: floods of junk and staged outages must not drop any.
TEST_QUEUED_MESSAGES = 1_000_000
MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")


class BrokerError(RuntimeError):
    """The broker binary is missing, or it did not start or stop in time."""


def find_mosquitto() -> str | None:
    """The mosquitto binary, or None; tests skip with a clear reason when it is None."""
    for path in MOSQUITTO_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mosquitto")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
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
        creds: security.CredentialSet | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.binary = binary or find_mosquitto()
        if self.binary is None:
            raise BrokerError("mosquitto is not installed (apt-get install mosquitto)")
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="felix-broker-")
        self.dir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.dir.mkdir(parents=True, exist_ok=True)
        # ``creds``: logins made elsewhere (one shard's of ``ShardedBrokers``)
        self.creds = creds if creds is not None else security.generate(self.dir, num_clients, run_id)
        self.host = host  # the listener's address: 127.0.0.1 but for the capacity benchmark's namespaces
        self.port = free_port(host)
        self.log_file = self.dir / "mosquitto.log"
        self.conf = self.dir / "mosquitto.conf"
        (self.dir / "db").mkdir(exist_ok=True)
        certs = make_test_ca(self.dir) if tls else None
        self.ca_file = certs[0] if certs else None  # clients verify the broker against it (--tls-ca)
        # The package's configuration, with room for the tests: messages up to ``max_message_bytes``
        # (64 MiB by default, so that the server's own size refusal is what tests meet) and a
        # message queue large enough for the floods and outages they stage.
        limits = BrokerLimits.for_run(num_clients, num_clients, max_message_bytes)
        limits = replace(limits, max_queued_messages=max(limits.max_queued_messages, TEST_QUEUED_MESSAGES))
        self.conf.write_text(
            mosquitto_conf(
                listen=(host, self.port),
                password_file=self.creds.password_file,
                acl_file=self.creds.acl_file,
                persistence_dir=self.dir / "db",
                limits=limits,
                log_file=self.log_file,
                tls=certs,
            )
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

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
            if _port_open(self.host, self.port):
                return
            time.sleep(0.05)
        self.stop()
        raise BrokerError(
            f"mosquitto did not listen on {self.address} within {timeout} s\n{self._log_tail()}"
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


class ShardedBrokers:
    """Several brokers, one per shard (``felix.deploy.shards``): one ``credentials.json`` for all,
    each broker with the server's and its own clients' logins and ACL only. A context manager;
    ``address`` is the ``--broker`` list in shard order. ``iterations``: of the password hashes
    (fewer make throwaway logins for 100,000 clients quick to write and for the brokers to check)."""

    def __init__(
        self,
        num_clients: int,
        shards: int,
        workdir: Path,
        run_id: str | None = None,
        host: str = "127.0.0.1",
        iterations: int = security.PBKDF2_ITERATIONS,
    ) -> None:
        sets = security.generate_shards(workdir, num_clients, shards, run_id, iterations)
        self.credentials_file = sets[0].credentials
        # Mosquitto reads its password file and ACL before it listens: ~20,000 logins take seconds.
        self.start_timeout = 10.0 + num_clients / (500 * shards)
        self.brokers = [
            MosquittoBroker(num_clients, run_id, workdir / f"shard-{k}", creds=c, host=host)
            for k, c in enumerate(sets)
        ]

    @property
    def address(self) -> str:
        return ",".join(b.address for b in self.brokers)

    def __enter__(self) -> Self:
        try:
            for b in self.brokers:
                b.start(timeout=self.start_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for b in self.brokers:
            b.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
