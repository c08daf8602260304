"""Named strategies (the papers' table rows) and named scenarios.

A strategy preset sets only the strategy axes (orchestrator mode and knowledge, selectors,
aggregator); a scenario preset sets the data, population, traces and targets. Merge order:
defaults <- scenario/config file <- strategy preset <- --set.
"""
from __future__ import annotations

from typing import Any

from felix.config import ConfigError

_SYNC = {"mode": "sync", "agg_goal": 10, "overcommit": 1.3, "deadline_s": None, "cancel_stragglers": True}
_ASYNC = {"mode": "async", "agg_goal": 10, "concurrency": 30}

STRATEGIES: dict[str, dict[str, Any]] = {
    # Random selection, sync rounds, no availability knowledge and no timeout: stalls under churn.
    "fedavg": {
        "orchestrator": {**_SYNC, "knowledge": "none", "task_timeout_s": None},
        "selector": {"name": "random"},
        "eval_selector": {"name": "none"},
        "aggregator": {"name": "fedavg", "server_lr": 1.0, "normalize": "weights"},
    },
    # Random selection, async buffer, 1/sqrt(1+T) weights; learns of trouble by the 90 s timeout.
    "fedbuff": {
        "orchestrator": {**_ASYNC, "knowledge": "none", "task_timeout_s": 90.0},
        "selector": {"name": "random"},
        "eval_selector": {"name": "none"},
        "aggregator": {"name": "fedbuff", "server_lr": 1.0, "normalize": "weights"},
    },
}

SCENARIOS: dict[str, dict[str, Any]] = {
    # The offline default: scikit-learn's bundled digits, 100 skewed clients, 90% slotted churn.
    "default": {
        "name": "digits-churn90",
        "strategy": "fedbuff",
        "model": "small_cnn",
        "dataset": {"name": "digits"},
        "partition": {"kind": "dirichlet", "num_clients": 100, "alpha": 0.3},
        "trace": {"kind": "slotted", "unavailable_fraction": 0.1},
        "runtime": {"kind": "halfnormal"},
        "client": {"lr": 0.05, "batch_size": 16, "epochs": 1},
        "run": {"target_accuracy": 0.85, "target_window": 5, "max_time_s": 86400.0},
    },
}


def strategy_preset(name: str) -> dict[str, Any]:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy preset {name!r}; choose one of {sorted(STRATEGIES)}") from None


def scenario_preset(name: str) -> dict[str, Any]:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"unknown scenario {name!r}; choose one of {sorted(SCENARIOS)}") from None
