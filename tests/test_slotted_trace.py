"""The slotted churn trace is built in numpy (thousands of emulated devices start in seconds); it
must be the very trace the per-event construction gave, so simulations do not change."""

from __future__ import annotations

import numpy as np
import pytest

from felix.core.types import Tier
from felix.scenario.traces import DeviceTrace, slotted_churn


@pytest.mark.parametrize("head_s", [0.0, 30.0])
def test_vectorised_slotted_trace_equals_the_event_construction(head_s: float) -> None:
    n, slot, horizon = 9, 60.0, 3600.0
    trace = slotted_churn(n, 0.3, np.random.default_rng(5), slot, horizon, head_s)
    rng = np.random.default_rng(5)  # the same draws, replayed through DeviceTrace.from_events
    n_slots = int(horizon // slot)
    down = np.zeros((n_slots, n), dtype=bool)
    for s in range(n_slots):
        down[s, rng.choice(n, size=round(0.3 * n), replace=False)] = True
    for d in range(n):
        events = [(head_s + s * slot, Tier.UN_AVL if down[s, d] else Tier.AVL_TRAIN) for s in range(n_slots)]
        ref = DeviceTrace.from_events(
            events, period=head_s + n_slots * slot if head_s == 0 else None, initial=Tier.AVL_TRAIN
        )
        got = trace.devices[d]
        assert np.array_equal(got.times, ref.times) and np.array_equal(got.tiers, ref.tiers)
        assert got.period == ref.period and got.tiers.dtype == ref.tiers.dtype
