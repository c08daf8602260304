"""Network namespaces for the capacity benchmark's load generators: a source address each.

One source address holds about 28,000 connections to one broker port (the ephemeral port range,
32768-60999 by default), so 100,000 clients cannot all come from 127.0.0.1. Each load-generator
process runs in a network namespace of its own, joined to this one by a veth pair
(``10.213.K.2`` inside, ``10.213.K.1`` here); the brokers listen on ``BROKER_ADDRESS``, which is
added to this namespace's loopback device for the run. Traffic stays on the machine: the
addresses are private, a namespace's only route is the one to ``BROKER_ADDRESS`` over its veth,
and nothing forwards packets (``ip_forward`` is not touched).

Everything made is removed when the context exits, also on an error or SIGTERM (turned into
``SystemExit`` while inside), and a namespace left by an earlier run that was killed with SIGKILL
is removed the next time (the names carry this module's prefix). Needs root (``CAP_NET_ADMIN``)
and ``ip`` from iproute2; without them :class:`NamespaceError` says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Self

PREFIX = "felixcap"  # namespace names: PREFIX-<k>
BROKER_ADDRESS = "10.213.0.1"  # on this namespace's loopback while the context is open
SUBNET = "10.213"


class NamespaceError(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, a failed command): one line saying why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class LoadgenNamespaces:
    """``count`` namespaces ``felixcap-0``.., each with a veth to this one; ``prefix(k)`` is the
    command prefix that runs a program in namespace ``k``. A context manager."""

    def __init__(self, count: int) -> None:
        if os.geteuid() != 0:
            raise NamespaceError("load-generator namespaces need root (CAP_NET_ADMIN); or pass --no-netns")
        if shutil.which("ip") is None:
            raise NamespaceError("the ip command (iproute2) is not installed; or pass --no-netns")
        if not 1 <= count <= 200:
            raise NamespaceError(f"between 1 and 200 load-generator namespaces, not {count}")
        self.count = count
        self.names = [f"{PREFIX}-{k}" for k in range(count)]
        self._made: list[str] = []
        self._address_added = False
        self._old_term: signal.Handlers | None = None

    @staticmethod
    def address(k: int) -> str:
        """Namespace ``k``'s own (source) address."""
        return f"{SUBNET}.{k + 1}.2"

    def prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[k]]

    def __enter__(self) -> Self:
        self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)  # type: ignore[assignment]
        try:
            self._remove_stale()
            _ip("addr", "add", f"{BROKER_ADDRESS}/32", "dev", "lo")
            self._address_added = True
            for k, ns in enumerate(self.names):
                host, inside = f"fcap{k}h", f"fcap{k}n"
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", host, "type", "veth", "peer", "name", inside, "netns", ns)
                _ip("addr", "add", f"{SUBNET}.{k + 1}.1/24", "dev", host)
                _ip("link", "set", host, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", f"{BROKER_ADDRESS}/32", "via", f"{SUBNET}.{k + 1}.1")
        except BaseException:
            self.close()
            raise
        return self

    def _remove_stale(self) -> None:
        """Namespaces and the broker address left by a run that was killed outright."""
        listed = _ip("netns", "list", check=False).stdout.split()
        for ns in listed:
            if ns.startswith(f"{PREFIX}-"):
                _ip("netns", "del", ns, check=False)
        _ip("addr", "del", f"{BROKER_ADDRESS}/32", "dev", "lo", check=False)

    def close(self) -> None:
        """Remove every namespace (its veth pair goes with it) and the broker address."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []
        if self._address_added:
            _ip("addr", "del", f"{BROKER_ADDRESS}/32", "dev", "lo", check=False)
            self._address_added = False
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
