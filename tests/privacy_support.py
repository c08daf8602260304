"""What the privacy tests share: a tiny simulated population to run private configs on, and the
dp-accounting import that skips a test where the privacy extra is absent."""

from __future__ import annotations

from typing import Any

import pytest


def tiny(max_aggregations: int) -> dict[str, Any]:
    """A 12-client always-available MLP run of ``max_aggregations`` aggregations of 2 (4 running),
    every aggregation divided by its count: small enough for a private run in a test."""
    return {
        "partition": {"num_clients": 12},
        "model": "mlp",
        "trace": {"kind": "always"},
        "run": {
            "max_aggregations": max_aggregations,
            "target_accuracy": 0.3,
            "target_window": 1,
            "stop_at_target": False,
        },
        "orchestrator": {"concurrency": 4, "agg_goal": 2},
        "aggregator": {"normalize": "count"},
    }


def dp() -> Any:
    """Google's dp-accounting, or a skip naming the extra that installs it."""
    return pytest.importorskip(
        "dp_accounting", reason="extra felix-fl[privacy] (dp-accounting) not installed"
    )
