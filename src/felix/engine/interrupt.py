"""Ctrl-C and SIGTERM stop a run cleanly: the shells and the CLI catch the signals here and ask the
run controller to stop (``RunController.request_stop``), so the run ends after the event in hand
with ``stop_reason: interrupted`` and writes everything it measured. A second signal while the run
winds down raises ``KeyboardInterrupt`` as usual (the way out of a stuck final step)."""
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
    seen = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal seen
        if seen:
            raise KeyboardInterrupt
        seen = True
        stop()

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
