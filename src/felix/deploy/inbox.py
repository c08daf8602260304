"""The inbox of the server and of a client host: messages from paho's network threads to the loop, bounded.

A link receives messages on its network thread and the loop handles them one at a time; with an
unbounded queue between them a flood (or a loop slower than the broker) holds every payload in
memory until the process runs out of it, before any acknowledgement-based back-pressure applies.
Here a put blocks the network thread while ``max_bytes`` of payload or ``max_messages`` are
queued: paho stops reading its socket, TCP flow control stops the broker, and the broker keeps
(or, past its own limits, drops) what it cannot deliver; the server's memory stays flat. One
message larger than ``max_bytes`` is still admitted into an empty inbox, so nothing deadlocks.

A link hands over each read pass of its network thread at once (``put_many``: one lock round trip
and one wake-up of the loop per pass, not per message); a pass larger than the room left goes in
as parts, so the bounds hold exactly. Nothing is dropped while the process runs: a waiting
``put_many`` has not returned, so the link has not acknowledged those messages (it does after the
hand-over, or the owner does, later) nor read the ones behind them; the broker keeps them.
``close`` (before the links' network threads are joined) wakes a blocked put, which then drops
the rest of its pass; the link acknowledges none of that pass, so the broker redelivers it to the
next session (the parts already queued arrive twice, and the receiver drops the copies).

A network thread waiting for room keeps its connection alive: each slice of the wait
(``WAIT_SLICE_S``) it writes what its link has queued and a PINGREQ when one is due
(``felix.deploy.blocked``), so the broker never drops a link because its owner is behind.

Items carry a ``tag``: a client host runs many clients' links into one inbox, and the tag says
whose link a message came in on (the server's single link uses 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from felix.deploy.blocked import serve_waiting_link
from felix.deploy.model_fetch import Fetched
from felix.deploy.transport import Connected, Delivery

log = logging.getLogger("felix.deploy.inbox")

Item = Delivery | Connected | Fetched  # a message, a (re)connection, a model download that ended
WAIT_SLICE_S = 0.2  # a put waiting for room lets its link's upkeep run this often


class Inbox:
    """A FIFO bounded by payload bytes and by count; notices (``Connected``, ``Fetched``) bypass the bound."""

    def __init__(self, max_bytes: int, max_messages: int) -> None:
        if max_bytes < 1 or max_messages < 1:
            raise ValueError("the inbox bounds must be positive")
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._items: deque[tuple[int, Item]] = deque()
        self._bytes = 0
        self._messages = 0
        self._closed = False
        self._cond = threading.Condition()
        self.full_waits = 0  # puts that had to wait for room (back-pressure reached the network thread)
        self.dropped = 0  # puts abandoned by close()

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item, tag: int = 0) -> None:
        """Queue ``item``; a ``Delivery`` waits while the inbox is full (never after ``close``)."""
        if not isinstance(item, (Connected, Fetched)):
            self.put_many([item], tag)
            return
        with self._cond:
            self._items.append((tag, item))
            self._cond.notify_all()

    def put_many(self, items: list[Delivery], tag: int = 0) -> bool:
        """Queue a network thread's read pass (one lock round trip and one wake-up of the loop per
        pass when it fits, instead of one per message), waiting while the inbox is full. A pass
        larger than the room left goes in as parts, as much as fits each time (at least one message
        into an empty inbox), so the bounds hold however many messages one pass holds. False if
        ``close`` dropped the rest of it (what was queued before stays queued)."""
        taken, waited = 0, False
        with self._cond:
            while taken < len(items) and not self._closed:
                n = self._room(items, taken)
                if n == 0:
                    if not waited:
                        waited = True
                        self._count_wait()
                    self._cond.wait(WAIT_SLICE_S)
                    self._cond.release()  # the link's upkeep runs outside the lock
                    try:
                        serve_waiting_link()
                    finally:
                        self._cond.acquire()
                    continue
                part = items[taken : taken + n]
                self._bytes += sum(len(item.payload) for item in part)
                self._messages += n
                self._items.extend((tag, item) for item in part)
                taken += n
                self._cond.notify_all()
            self.dropped += len(items) - taken
            return taken == len(items)

    def _room(self, items: list[Delivery], start: int) -> int:
        """How many of ``items[start:]`` fit now (one at least when the inbox is empty)."""
        n, size = 0, self._bytes
        for item in items[start:]:
            size += len(item.payload)
            if self._messages + n and (size > self.max_bytes or self._messages + n + 1 > self.max_messages):
                break
            n += 1
        return n

    def _count_wait(self) -> None:
        self.full_waits += 1
        if self.full_waits & (self.full_waits - 1) == 0:  # the 1st, 2nd, 4th, ... wait
            log.warning(
                "inbox full (%d messages, %d bytes): a network thread waits and the broker "
                "holds what follows (%d waits so far)",
                self._messages,
                self._bytes,
                self.full_waits,
            )

    def get_batch(
        self, timeout: float, limit: int, only: Callable[[Item], bool] | None = None
    ) -> list[tuple[int, Item]]:
        """Up to ``limit`` of the oldest ``(tag, item)``, waiting up to ``timeout`` seconds for the first
        (empty list: none came). Taking what has queued at once costs one lock round trip and one
        wake-up of a waiting network thread per batch instead of per message. ``only``: take just
        the items it accepts, leaving the others queued in order (the server reads a secure
        aggregation's messages past the ones it cannot hold)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (out := self._take(limit, only)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            for _, item in out:
                if not isinstance(item, (Connected, Fetched)):  # a message: it counted against the bounds
                    self._bytes -= len(item.payload)
                    self._messages -= 1
            self._cond.notify_all()
            return out

    def _take(self, limit: int, only: Callable[[Item], bool] | None) -> list[tuple[int, Item]]:
        items = self._items
        if only is None:
            return [items.popleft() for _ in range(min(limit, len(items)))]
        out: list[tuple[int, Item]] = []
        kept: deque[tuple[int, Item]] = deque()
        while items and len(out) < limit:
            entry = items.popleft()
            (out if only(entry[1]) else kept).append(entry)
        kept.extend(items)
        self._items = kept
        return out

    def close(self) -> None:
        """Stop accepting: blocked and later ``put`` calls drop their message and return."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
