"""Aggregator stall time: virtual time in which nothing on the way can make the next model version.

The aggregator *stalls* while no training task holds a slot: its buffer is short of an
aggregation (a full one aggregates at once) and no client is training for it, so the next version
waits for a client to become available (or for a late reply of a task that lost its slot). The
run controller observes the orchestrator after every event it hands on; the state only changes
at events, so the stall is exact in virtual time for both shells. Each interval between
consecutive model versions (the first from the run's start) gets the stall it contained; the
time after the last version counts in the total only.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class StallClock:
    """Stall time so far (``observe`` after each event, ``advance`` at the end)."""

    def __init__(self) -> None:
        self.since: float | None = None  # the stall began (or was last accounted) at this time
        self.current = 0.0  # stall in the open interval (since the last model version)
        self.total = 0.0
        self.per_interval: list[float] = []  # stall within each closed interval between versions

    def advance(self, now: float) -> None:
        """Account the stall up to ``now`` (the state has not changed since the last event)."""
        if self.since is not None and now > self.since:
            self.current += now - self.since
            self.total += now - self.since
            self.since = now

    def observe(self, now: float, versions: int, starved: bool) -> None:
        """An event at ``now`` made ``versions`` new model versions and left the orchestrator
        ``starved`` (no training task holding a slot) or not."""
        self.advance(now)
        for _ in range(versions):
            self.per_interval.append(self.current)
            self.current = 0.0
        self.since = now if starved else None

    def diagnostics(self, run_time_s: float) -> dict[str, float | None]:
        """The summary's ``aggregator_stall_*`` fields (None where undefined: no interval closed)."""
        per = np.asarray(self.per_interval, dtype=np.float64)
        return {
            "aggregator_stall_s": self.total,
            "aggregator_stall_share": self.total / run_time_s if run_time_s > 0 else None,
            "aggregator_stall_mean_s": float(per.mean()) if per.size else None,
            "aggregator_stall_p50_s": float(np.percentile(per, 50)) if per.size else None,
            "aggregator_stall_p95_s": float(np.percentile(per, 95)) if per.size else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "current": self.current,
            "total": self.total,
            "per_interval": np.asarray(self.per_interval, dtype=np.float64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.since = None if state["since"] is None else float(state["since"])
        self.current = float(state["current"])
        self.total = float(state["total"])
        self.per_interval = np.asarray(state["per_interval"], dtype=np.float64).tolist()
