"""The orchestrator's counters and per-update statistics, and their checkpoint form.

Kept apart from the orchestrator because the metrics layer and the policies read them
(``felix.core.view`` names this type) without needing the orchestrator itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

#: The per-update statistics lists (they only grow), stored as arrays in a checkpoint.
LIST_STATS = frozenset({"aggregation_times", "staleness", "agg_weights", "utility_age_at_selection"})
_FLOAT_STATS = frozenset({"aggregation_times", "agg_weights"})


@dataclass(slots=True)
class OrchestratorStats:
    """Counters and per-event diagnostics the metrics layer turns into a report."""

    train_dispatched: int = 0
    eval_dispatched: int = 0
    evals_done: int = 0
    updates_applied: int = 0
    updates_discarded: int = 0  # accepted messages not aggregated: too stale, or late after cancel
    rejected: int = 0  # malformed / forged / replayed messages
    updates_clipped: int = 0  # accepted after scaling down to the validator's norm bound
    train_dropped: int = 0  # training tasks that lost their slot mid-task (interrupt or timeout)
    train_cancelled: int = 0
    rounds_started: int = 0
    aggregation_times: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    agg_weights: list[float] = field(default_factory=list)
    utility_age_at_selection: list[int] = field(default_factory=list)
    never_explored_at_selection: int = 0


class StatsCheckpoint:
    """Converts ``OrchestratorStats`` to and from a checkpoint, converting only what each list
    gained since the last save (the lists only grow), so a checkpoint copies history instead of
    re-reading it."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def _array(self, stats: OrchestratorStats, name: str) -> np.ndarray:
        values = getattr(stats, name)
        cached = self._arrays.get(name)
        done = 0 if cached is None or len(cached) > len(values) else len(cached)
        tail = np.asarray(values[done:], dtype=np.float64 if name in _FLOAT_STATS else np.int64)
        arr = tail if done == 0 else np.concatenate([cached, tail])  # type: ignore[list-item]
        self._arrays[name] = arr
        return arr

    def state_dict(self, stats: OrchestratorStats) -> dict[str, Any]:
        return {
            f.name: self._array(stats, f.name) if f.name in LIST_STATS else getattr(stats, f.name)
            for f in fields(stats)
        }

    def load_state_dict(self, stats: OrchestratorStats, saved: dict[str, Any]) -> None:
        self._arrays = {}
        for f in fields(stats):
            v = saved[f.name]
            setattr(stats, f.name, np.asarray(v).tolist() if f.name in LIST_STATS else v)


__all__ = ["LIST_STATS", "OrchestratorStats", "StatsCheckpoint"]
