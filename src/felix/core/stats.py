"""The orchestrator's counters and per-update statistics, and their checkpoint form.

Kept apart from the orchestrator because the metrics layer and the policies read them
(``felix.core.view`` names this type) without needing the orchestrator itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

#: The per-update statistics lists (they only grow), stored as arrays in a checkpoint.
LIST_STATS = frozenset(
    {
        "aggregation_times",
        "staleness",
        "agg_weights",
        "utility_age_at_selection",
        "selected_utility",
        "selected_compute_s",
    }
)
_FLOAT_STATS = frozenset({"aggregation_times", "agg_weights", "selected_utility", "selected_compute_s"})


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
    # What the orchestrator knew of each client it picked to train, at the pick (FeLiX Fig. 13 / 14):
    # its statistical utility (explored clients only) and its last training task's duration (clients
    # that trained before only; ``never_trained_at_selection`` counts the others).
    selected_utility: list[float] = field(default_factory=list)
    selected_compute_s: list[float] = field(default_factory=list)
    never_trained_at_selection: int = 0

    def mark(self) -> dict[str, int]:
        """Where the stats stand (counters, and the lists' lengths), for ``rewind``."""
        return {n: len(getattr(self, n)) if n in LIST_STATS else getattr(self, n) for n in _NAMES}

    def rewind(self, mark: dict[str, int]) -> None:
        """Back to ``mark``: the counters restored, the lists cut to their lengths then."""
        for name, v in mark.items():
            if name in LIST_STATS:
                del getattr(self, name)[v:]
            else:
                setattr(self, name, v)


_NAMES = tuple(f.name for f in fields(OrchestratorStats))  # (``fields`` is slow per call)


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
            if f.name not in saved:  # a checkpoint from before the statistic existed: none recorded
                setattr(stats, f.name, getattr(OrchestratorStats(), f.name))
                continue
            v = saved[f.name]
            setattr(stats, f.name, np.asarray(v).tolist() if f.name in LIST_STATS else v)


class ModelPath:
    """How far the model has moved: the cumulative relative movement (the sum over aggregations
    of the step's norm over the new model's norm), and its value when each round began, for eval
    selectors that skip probes when the model has barely moved since a client's utility was
    measured (``SelectionContext.model_path``)."""

    def __init__(self) -> None:
        self._at_round = np.zeros(64, dtype=np.float64)
        self.total = 0.0

    def moved(self, old: np.ndarray, new: np.ndarray) -> None:
        """An aggregation replaced ``old`` by ``new``."""
        norm = float(np.linalg.norm(new))
        if norm > 0:
            self.total += float(np.linalg.norm(new - old)) / norm

    def start_round(self, current: int, round_: int) -> None:
        """Rounds ``current + 1`` to ``round_`` begin now, at the path's total."""
        if round_ >= len(self._at_round):
            grown = np.zeros(max(2 * len(self._at_round), round_ + 1), dtype=np.float64)
            grown[: len(self._at_round)] = self._at_round
            self._at_round = grown
        self._at_round[current + 1 : round_ + 1] = self.total

    def upto(self, round_: int) -> np.ndarray:
        """The path at the start of rounds 0..``round_`` (a view)."""
        return self._at_round[: round_ + 1]

    def state_dict(self, round_: int) -> dict[str, Any]:
        return {"model_path": np.array(self._at_round[: round_ + 1]), "model_path_total": self.total}

    def load_state_dict(self, state: dict[str, Any], round_: int) -> None:
        # A checkpoint from before the model's path was kept restarts it at 0 (no movement known).
        path = np.asarray(state.get("model_path", np.zeros(round_ + 1)), dtype=np.float64)
        self._at_round = np.zeros(max(64, 2 * len(path)), dtype=np.float64)
        self._at_round[: len(path)] = path
        self.total = float(state.get("model_path_total", 0.0))


__all__ = ["LIST_STATS", "ModelPath", "OrchestratorStats", "StatsCheckpoint"]
