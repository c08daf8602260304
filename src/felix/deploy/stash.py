"""The messages a deployed server holds while a secure-aggregation group runs, bounded.

While a group runs, the server loop is inside the aggregation and can hand the orchestrator
nothing; it must still read its inbox for the group's own messages. Every other message read
meanwhile waits here, unhandled and unacknowledged, and is handled in arrival order once the
aggregation is over. Two things keep this from growing with a flood:

- a message is charged to its sender's admission budget (rate and cost: ``ServerProtocol.admit``)
  when it is stashed, and one over the budget is refused at once, as it would be later (the
  server does not charge a stashed message again when it handles it);
- the stash holds at most ``max_bytes`` of payload and ``max_messages`` (the inbox's own bounds;
  one message into an empty stash whatever its size). While it is full, the server takes only
  secure-aggregation messages out of the inbox and leaves the rest there in order: the inbox
  fills, its bound blocks the link's network thread, and TCP flow control pushes back on the
  broker, which keeps what follows. Nothing is dropped; the group's own messages get through until
  the inbox is full too, after which its stages end at their deadlines.

Notices (``Connected``, ``Fetched``) are kept in order but not counted against the bounds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from felix.deploy.inbox import Item
from felix.deploy.transport import Delivery


class Stash:
    """A FIFO of held messages, bounded by payload bytes and by count."""

    def __init__(self, max_bytes: int, max_messages: int) -> None:
        if max_bytes < 1 or max_messages < 1:
            raise ValueError("the stash bounds must be positive")
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._items: deque[Item] = deque()
        self.bytes = 0
        self.messages = 0
        self.peak_messages = 0  # the most messages held at once, for the summary
        self.full_reads = 0  # reads of the inbox that left messages queued there: the stash was full

    def __len__(self) -> int:
        return len(self._items)

    def fits(self) -> Callable[[Item], bool]:
        """For one read of the inbox: whether each item in turn still fits beside what is held and
        what the read took before it. Once one does not, none after it does, notices included, so
        that what is held stays in arrival order."""
        size, count, stopped = self.bytes, self.messages, False

        def take(item: Item) -> bool:
            nonlocal size, count, stopped
            n = len(item.payload) if isinstance(item, Delivery) else 0
            if not stopped and isinstance(item, Delivery) and count:
                stopped = size + n > self.max_bytes or count + 1 > self.max_messages
                self.full_reads += stopped
            if stopped:
                return False
            if isinstance(item, Delivery):
                size, count = size + n, count + 1
            return True

        return take

    def push(self, item: Item) -> None:
        if isinstance(item, Delivery):
            self.bytes += len(item.payload)
            self.messages += 1
            self.peak_messages = max(self.peak_messages, self.messages)
        self._items.append(item)

    def pop(self) -> Item:
        item = self._items.popleft()
        if isinstance(item, Delivery):
            self.bytes -= len(item.payload)
            self.messages -= 1
        return item


__all__ = ["Stash"]
