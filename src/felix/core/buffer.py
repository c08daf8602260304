"""The aggregation buffer: accepted training updates waiting for the next model version.

The orchestrator decides *when* to aggregate (through its round policy) and the aggregator *how*;
this module holds what lies between: the waiting updates, their staleness at aggregation time,
the refusal of a step that would leave the model non-finite, the backstop that drops the updates
that cannot be aggregated, and the buffer's part of a checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from felix.core.aggregation import Aggregator
from felix.core.types import BufferedUpdate, ClientUpdate

AggregateResult = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]


class AggregationBuffer:
    """Accepted updates, in arrival order."""

    def __init__(self) -> None:
        self.items: list[BufferedUpdate] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: BufferedUpdate) -> None:
        self.items.append(item)

    def aggregate(
        self, aggregator: Aggregator, theta: np.ndarray, version: int
    ) -> tuple[list[BufferedUpdate], AggregateResult]:
        """Aggregate every waiting update onto ``theta`` (the model of ``version``) and empty the
        buffer; returns the updates used and the aggregator's result. Raises ValueError or
        ArithmeticError, with the buffer kept, if the step fails or leaves the model non-finite."""
        for b in self.items:
            b.staleness = version - b.base_version
        result = step(aggregator, theta, self.items)
        used, self.items = self.items, []
        return used, result

    def drop_unaggregatable(self, aggregator: Aggregator, theta: np.ndarray) -> list[BufferedUpdate]:
        """Aggregation failed: remove the updates that fail on their own, or else the newest one,
        and keep the rest. Validation should make this unreachable; it is the backstop that keeps
        one bad update from wedging (or crashing) the run, with the model unchanged."""
        bad = []
        for b in self.items:
            try:
                step(aggregator, theta, [b])
            except (ValueError, ArithmeticError):
                bad.append(b)
        dropped = bad or self.items[-1:]
        for b in dropped:
            self.items.remove(b)
        return dropped

    def state_dict(self) -> list[dict[str, Any]]:
        """The waiting updates as plain values and arrays (the ``buffer`` key of a checkpoint)."""
        return [
            {
                "client_id": b.client_id,
                "task_id": b.task_id,
                "base_version": b.base_version,
                "arrived_at": b.arrived_at,
                "staleness": b.staleness,
                "num_samples": b.update.num_samples,
                "stat_utility": b.update.stat_utility,
                "loss": b.update.loss,
                "duration": b.update.duration,
                "delta": None if b.update.delta is None else np.asarray(b.update.delta),
                "aux": {k: np.asarray(v) for k, v in b.update.aux.items()},
                "data_span": None if b.update.data_span is None else np.asarray(b.update.data_span),
            }
            for b in self.items
        ]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.items = [
            BufferedUpdate(
                int(b["client_id"]),
                int(b["task_id"]),
                int(b["base_version"]),
                float(b["arrived_at"]),
                ClientUpdate(
                    int(b["num_samples"]),
                    float(b["stat_utility"]),
                    float(b["loss"]),
                    float(b["duration"]),
                    None if b["delta"] is None else np.array(b["delta"]),
                    {k: np.asarray(v) for k, v in b["aux"].items()},
                    _span(b.get("data_span")),
                ),
                int(b["staleness"]),
            )
            for b in state
        ]


def step(aggregator: Aggregator, theta: np.ndarray, buffer: list[BufferedUpdate]) -> AggregateResult:
    """The aggregator's step, refused (ValueError) if it would leave the model non-finite."""
    new, norm_w, aux = aggregator.aggregate(theta, buffer)
    if not np.isfinite(new).all():
        raise ValueError("the aggregate holds non-finite values")
    return new, norm_w, aux


def _span(value: object) -> tuple[float, float] | None:
    """A checkpointed update's data span (absent from checkpoints written before streams)."""
    if value is None:
        return None
    a = np.asarray(value, dtype=np.float64)
    return float(a[0]), float(a[1])


__all__ = ["AggregationBuffer", "step"]
