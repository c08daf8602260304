"""Ctrl-C and SIGTERM stop a run cleanly: the shells and the CLI catch the signals here and ask the
run controller to stop (``RunController.request_stop``), so the run ends after the event in hand
with ``stop_reason: interrupted`` and writes everything it measured. A second Ctrl-C while the run
winds down raises ``KeyboardInterrupt`` as usual (the way out of a stuck final step); a repeated
SIGTERM only asks again (a ``felix compare`` driver forwards SIGTERM to its workers, which may
have had the terminal's SIGINT already)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals(stop: Callable[[], None], enabled: bool = True) -> Iterator[None]:
    """Within the block, the first SIGINT or SIGTERM calls ``stop``; the previous handlers come back
    after it. Signals can only be caught in the main thread: elsewhere (or not ``enabled``) this
    does nothing."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    me = _Block()

    def handler(signum: int, frame: FrameType | None) -> None:
        if me.seen and signum == signal.SIGINT:
            raise KeyboardInterrupt
        me.seen = True
        stop()

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    _ACTIVE.append(me)
    try:
        if any(block.seen for block in _ACTIVE[:-1]):
            # The signal reached an enclosing block (a comparison whose next run was being built):
            # this run stops as soon as it starts rather than running to its end.
            me.seen = True
            stop()
        yield
    finally:
        _ACTIVE.pop()
        for s, h in old.items():
            signal.signal(s, h)


class _Block:
    """One active ``stop_on_signals`` block: whether a stop signal has reached it."""

    seen = False


#: The active blocks, outermost first (main thread only).
_ACTIVE: list[_Block] = []


def ignore_stop_signals() -> None:
    """For worker processes that a driver stops (``felix compare --jobs N``): outside a run they
    ignore SIGINT and SIGTERM, so that a Ctrl-C reaching the whole process group ends the runs
    cleanly without killing an idle worker (which would break the pool and lose the others)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
