"""What a link's network thread does while its owner makes it wait.

A link hands each read pass to its owner from its network thread, and the owner's bounded inbox
(``felix.deploy.inbox``) makes that thread wait while it is full: that wait is the back-pressure
(the link reads no more, TCP stops the broker, the server's memory stays flat). But the same
thread writes the connection's packets and keeps it alive: blocked, it sent no PINGREQ and no
PUBACK, so a wait longer than the keep-alive got the connection dropped by the broker, and under
overload (a full inbox for tens of seconds) the server's links reconnected again and again, each
time taking a redelivery of everything unacknowledged. Here a link registers, for the length of a
hand-over, what its thread must keep doing (``keeping_alive``); the inbox, while it makes that
thread wait, calls it every slice of its wait (``serve_waiting_link``), on that same thread and
outside its lock: the link then writes what is queued (acknowledgements, a PINGREQ every half
keep-alive) but reads nothing, so the bound still holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


@contextmanager
def keeping_alive(service: Callable[[], None]) -> Iterator[None]:
    """While the body runs (a hand-over to the owner), a wait in it calls ``service``."""
    prior = getattr(_local, "service", None)
    _local.service = service
    try:
        yield
    finally:
        _local.service = prior


def serve_waiting_link() -> None:
    """Called by an owner while it makes the current thread wait: the link's upkeep, if a link's
    network thread is the one waiting (nothing otherwise)."""
    service = getattr(_local, "service", None)
    if service is not None:
        service()
