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

_OORT = {"name": "oort", "params": {"base": "felix_authors"}}
_NO_EVAL = {"name": "none"}
_TIERSELECT_EVAL = {"name": "tierselect", "params": {}}


def _strategy(orch: dict[str, Any], selector: dict[str, Any], aggregator: dict[str, Any],
              eval_selector: dict[str, Any] = _NO_EVAL) -> dict[str, Any]:
    return {"orchestrator": orch, "selector": selector, "eval_selector": eval_selector, "aggregator": aggregator}


_FEDAVG_AGG = {"name": "fedavg", "server_lr": 1.0, "normalize": "weights", "params": {}}
_FEDBUFF_AGG = {"name": "fedbuff", "server_lr": 0.3, "normalize": "weights", "params": {}}
_TIERFUSE_AGG = {"name": "tierfuse", "server_lr": 0.3, "normalize": "weights", "params": {}}
_SYNC_NONE = {**_SYNC, "knowledge": "none", "task_timeout_s": None}  # no timeout: stalls as OORT does
_SYNC_ORACLE = {**_SYNC, "knowledge": "oracle", "task_timeout_s": None}
_ASYNC_NONE = {**_ASYNC, "knowledge": "none", "task_timeout_s": 90.0}
_ASYNC_ORACLE = {**_ASYNC, "knowledge": "oracle", "task_timeout_s": 90.0}
_ASYNC_TIERS = {**_ASYNC, "knowledge": "tiertrack", "task_timeout_s": 90.0}

STRATEGIES: dict[str, dict[str, Any]] = {
    # Random selection, sync rounds, no availability knowledge and no timeout: stalls under churn.
    "fedavg": _strategy(_SYNC_NONE, {"name": "random"}, _FEDAVG_AGG),
    # Random selection, async buffer, 1/sqrt(1+T) weights (FedScale's normalisation, server lr 1).
    "fedbuff": _strategy(_ASYNC_NONE, {"name": "random"}, {**_FEDBUFF_AGG, "server_lr": 1.0}),
    # FeLiX Table 1.
    "oort": _strategy(_SYNC_NONE, _OORT, _FEDAVG_AGG),
    "oort*": _strategy(_SYNC_ORACLE, _OORT, _FEDAVG_AGG),
    "oort-async": _strategy(_ASYNC_NONE, _OORT, _FEDBUFF_AGG),
    "oort-async*": _strategy(_ASYNC_ORACLE, _OORT, _FEDBUFF_AGG),
    "refl*": _strategy(
        {**_SYNC, "knowledge": "oracle", "task_timeout_s": None, "deadline_s": 100.0,
         "cancel_stragglers": False, "max_staleness": 5},
        {"name": "refl_ips", "params": {"oort": {"base": "fedscale", "blacklist_rounds": 50}}},
        {"name": "refl_saa", "server_lr": 1.0, "normalize": "weights", "params": {}},
    ),
    "felix": _strategy(_ASYNC_TIERS, _OORT, _TIERFUSE_AGG, _TIERSELECT_EVAL),
    # FeLiX ablations (§6.3).
    "felix-no-tierfuse": _strategy(_ASYNC_TIERS, _OORT, _FEDBUFF_AGG, _TIERSELECT_EVAL),
    "felix-no-eval": _strategy(_ASYNC_TIERS, _OORT, _TIERFUSE_AGG),
    "oort-async+tiertrack": _strategy(_ASYNC_TIERS, _OORT, _FEDBUFF_AGG),
}

MAIN_STRATEGIES = ("fedbuff", "oort", "oort*", "oort-async", "oort-async*", "refl*", "felix")

# The CPU-sized FeLiX reproduction: the authors' population (300 clients, Dirichlet 0.1, their
# half-normal runtimes, c = 30, aggGoal 10, 90 s timeout) on Fashion-MNIST with an MLP, so that
# the seven main strategies run in minutes on two cores.
_FELIX_CPU: dict[str, Any] = {
    "model": "mlp",
    "dataset": {"name": "fashion_mnist", "test_limit": 2000},
    "partition": {"kind": "dirichlet", "num_clients": 300, "alpha": 0.1},
    "runtime": {"kind": "halfnormal"},
    "client": {"lr": 0.04, "batch_size": 32, "epochs": 1},
    "run": {"target_accuracy": 0.80, "target_window": 10, "max_time_s": 12 * 3600.0, "eval_every": 1},
}
MOBIPERF_TRACE = "../shared/traces/mobiperf-300.json"

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
    "felix-cpu-100": {**_FELIX_CPU, "name": "felix-cpu-100", "trace": {"kind": "always"}},
    "felix-cpu-90": {**_FELIX_CPU, "name": "felix-cpu-90", "trace": {"kind": "slotted", "unavailable_fraction": 0.1}},
    "felix-cpu-50": {**_FELIX_CPU, "name": "felix-cpu-50", "trace": {"kind": "slotted", "unavailable_fraction": 0.5}},
    "felix-cpu-mobiperf": {**_FELIX_CPU, "name": "felix-cpu-mobiperf",
                           "trace": {"kind": "mobiperf", "path": MOBIPERF_TRACE, "series": "3_50"}},
    # Paper scale (for a GPU machine): CIFAR-10, the authors' 537,610-parameter CNN and settings.
    "felix-cifar10": {
        "name": "felix-cifar10",
        "model": "felix_cnn",
        "dataset": {"name": "cifar10", "root": "../shared/data/cifar10-jpeg.tar.gz"},
        "partition": {"kind": "dirichlet", "num_clients": 300, "alpha": 0.1},
        "trace": {"kind": "mobiperf", "path": MOBIPERF_TRACE, "series": "3_50"},
        "runtime": {"kind": "halfnormal"},
        "client": {"lr": 0.04, "batch_size": 32, "epochs": 1, "drop_last": True},
        "run": {"target_accuracy": 0.70, "target_window": 20, "max_time_s": 6 * 86400.0, "device": "cuda"},
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
