"""The summary's ``stream`` section (runs with ``stream.enabled``)."""

from __future__ import annotations

from typing import Any, Protocol

from felix.metrics.freshness import FreshnessTracker
from felix.stream.model import StreamModel


class _Streamed(Protocol):
    stream: StreamModel | None
    freshness: FreshnessTracker | None


def stream_summary(built: _Streamed, end: float) -> dict[str, Any]:
    """``{"stream": ...}``: freshness (felix.metrics.freshness) and the stream's own counts;
    ``{}`` for a run without streams, whose summary stays as it was."""
    if built.stream is None or built.freshness is None:
        return {}
    st = built.stream.stats()
    return {
        "stream": {
            **built.freshness.summary(end),
            "arrivals": st.arrivals,
            "dropped_by_cap": st.dropped,
            "clients_streamed": built.stream.clients_started,
        }
    }
