"""Recorded selection scenarios: a seeded fake shell drives the orchestrator through churn.

Each scenario registers clients in a shuffled id order (some ids far from the rest), changes
their tiers on a random schedule, lets tasks finish, fail and time out, and logs every dispatch
and the selector's pacer / exploration state at each aggregation. ``selection_fixture.json`` holds
the log of the per-client-record selectors this project had before the columnar ClientMap; the
equivalence test replays each scenario on today's code and compares the logs. Only the
orchestrator's event API is used, so the same driver ran on both.

Regenerate (only when a selection is *meant* to change):
``PYTHONPATH=src python tests/selection_scenarios.py > tests/data/selection_fixture.json``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from felix.core.commands import Command, DispatchEval, DispatchTrain, NewModelVersion
from felix.core.eval_selection import EvalSelector
from felix.core.events import ClientRegistered, TaskFailed, TaskFinished, Tick, TierChanged
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.selection import TrainSelector
from felix.core.types import ClientUpdate, Tier
from felix.core.validation import UpdateValidator, ValidationConfig
from felix.strategies.aggregation.fedavg import FedAvgAggregator, FedBuffAggregator
from felix.strategies.selection.oort import OortParams, OortSelector
from felix.strategies.selection.random import RandomSelector
from felix.strategies.selection.refl import ReflIPSParams, ReflIPSSelector
from felix.strategies.selection.tierselect import TierSelectEvalParams, tierselect

DIM = 4
HORIZON = 900.0  # seconds of virtual time


class ScheduleOracle:
    """Ground truth from the scenario's own tier schedule (for REFL's lookahead)."""

    def __init__(self, schedule: dict[int, list[tuple[float, Tier]]]) -> None:
        self.schedule = schedule

    def tier_at(self, client_id: int, t: float) -> Tier:
        tier = Tier.UN_AVL
        for when, tr in self.schedule[client_id]:
            if when > t:
                break
            tier = tr
        return tier

    def available_throughout(self, client_id: int, t0: float, t1: float) -> bool:
        if self.tier_at(client_id, t0) is not Tier.AVL_TRAIN:
            return False
        return all(tr is Tier.AVL_TRAIN for when, tr in self.schedule[client_id] if t0 < when <= t1)


def client_ids(n: int, rng: np.random.Generator) -> list[int]:
    """``n`` distinct ids in a shuffled registration order, a few of them far above the rest."""
    ids = list(range(n - 4)) + [10_000 + 7, 123_456, 2**40 + 3, 999]
    return [ids[i] for i in rng.permutation(n)]


def tier_schedule(ids: list[int], rng: np.random.Generator) -> dict[int, list[tuple[float, Tier]]]:
    tiers = (Tier.AVL_TRAIN, Tier.AVL_EVAL, Tier.UN_AVL)
    out: dict[int, list[tuple[float, Tier]]] = {}
    for cid in ids:
        t, seq = 0.0, []
        tier = tiers[int(rng.choice(3, p=[0.6, 0.2, 0.2]))]
        seq.append((0.0, tier))
        while t < HORIZON:
            t += float(rng.exponential(120.0))
            tier = tiers[int(rng.choice(3, p=[0.5, 0.25, 0.25]))]
            seq.append((round(t, 3), tier))
        out[cid] = seq
    return out


def _build(
    name: str, oracle: ScheduleOracle
) -> tuple[OrchestratorConfig, TrainSelector, EvalSelector | None]:
    if name == "felix-async":
        train, ev = tierselect(4, TierSelectEvalParams(staleness_threshold=3), reward_cap=64, pacer_step=2)
        cfg = OrchestratorConfig(
            mode="async", agg_goal=4, concurrency=8, task_timeout_s=25.0, knowledge=AvailabilityName.TIERTRACK
        )
        return cfg, train, ev
    if name == "oort-async-oracle":
        params = OortParams(
            exploration_factor=0.6,
            exploration_min=0.1,
            pacer_step=3,
            round_threshold=15.0,
            rounding="stochastic",
            blacklist_rounds=4,
            blacklist_max_len=0.05,
        )
        cfg = OrchestratorConfig(
            mode="async", agg_goal=3, concurrency=6, task_timeout_s=25.0, knowledge=AvailabilityName.ORACLE
        )
        return cfg, OortSelector(params), None
    if name == "oort-sync-none":
        cfg = OrchestratorConfig(
            mode="sync",
            agg_goal=5,
            overcommit=1.4,
            deadline_s=30.0,
            task_timeout_s=20.0,
            knowledge=AvailabilityName.NONE,
        )
        return cfg, OortSelector(OortParams(pacer_step=2, round_threshold=50.0)), None
    if name == "fedscale-blacklist":
        params = replace(OortParams.fedscale(), blacklist_rounds=2, blacklist_max_len=0.1, pacer_step=2)
        cfg = OrchestratorConfig(
            mode="sync", agg_goal=5, overcommit=1.3, task_timeout_s=25.0, knowledge=AvailabilityName.TIERTRACK
        )
        return cfg, OortSelector(params, reward_cap=50), None
    if name == "refl-oort":
        oort = OortSelector(replace(OortParams.fedscale(), blacklist_rounds=3), reward_cap=40)
        cfg = OrchestratorConfig(
            mode="sync",
            agg_goal=5,
            overcommit=1.3,
            deadline_s=40.0,
            task_timeout_s=30.0,
            knowledge=AvailabilityName.ORACLE,
        )
        return cfg, ReflIPSSelector(ReflIPSParams(time_window=60.0, prohibit_reselect=2), oort), None
    if name == "refl-random":
        cfg = OrchestratorConfig(
            mode="sync", agg_goal=4, overcommit=1.5, task_timeout_s=30.0, knowledge=AvailabilityName.TIERTRACK
        )
        return cfg, ReflIPSSelector(ReflIPSParams(time_window=50.0, avail_probability=0.0)), None
    if name == "random-async":
        cfg = OrchestratorConfig(
            mode="async", agg_goal=4, concurrency=7, task_timeout_s=25.0, knowledge=AvailabilityName.TIERTRACK
        )
        return cfg, RandomSelector(), None
    raise KeyError(name)


SEEDS = (0, 1)
SCENARIOS = (
    "felix-async",
    "oort-async-oracle",
    "oort-sync-none",
    "fedscale-blacklist",
    "refl-oort",
    "refl-random",
    "random-async",
)


def _selector_state(sel: TrainSelector) -> dict[str, Any]:
    oort = getattr(sel, "oort", None) if not isinstance(sel, OortSelector) else sel
    if oort is None:
        return {}
    return {
        "exploration": oort.exploration,
        "round_threshold": oort.round_threshold,
        "preferred_duration": None if not np.isfinite(oort.preferred_duration) else oort.preferred_duration,
        "exploited": oort.exploit_history[-1] if oort.exploit_history else None,
    }


def run_scenario(
    name: str,
    seed: int = 0,
    n_clients: int = 60,
    hook: Callable[[Orchestrator, int], Orchestrator] | None = None,
) -> dict[str, Any]:
    """Drive scenario ``name``; returns the dispatch log (kinds, clients in order) and selector states.

    ``hook(orch, events_handled)`` may return a replacement orchestrator before each event (used to
    swap in a restored copy mid-run); the log continues from whatever it returns.
    """
    rng = np.random.default_rng(seed)
    ids = client_ids(n_clients, rng)
    schedule = tier_schedule(ids, rng)
    oracle = ScheduleOracle(schedule)
    cfg, train, ev = _build(name, oracle)
    agg = FedBuffAggregator() if cfg.round_policy == "async" else FedAvgAggregator()
    orch = Orchestrator(
        cfg,
        np.zeros(DIM, np.float32),
        train,
        agg,
        np.random.default_rng(seed + 100),
        eval_selector=ev,
        oracle=oracle,
        # The synthetic shell's sample counts are not its clients' registrations, and the
        # recorded dispatches predate update validation: bound nothing here.
        validator=UpdateValidator(ValidationConfig(max_samples_factor=1e9, norm_policy="off")),
    )
    heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
    seq = itertools.count()
    log: dict[str, Any] = {"kinds": "", "clients": [], "states": []}
    shell_rng = np.random.default_rng(seed + 200)

    def emit(cmds: list[Command], now: float) -> None:
        for c in cmds:
            if isinstance(c, (DispatchTrain, DispatchEval)):
                train_task = isinstance(c, DispatchTrain)
                log["kinds"] += "T" if train_task else "E"
                log["clients"].append(int(c.client_id))
                dur = float(shell_rng.uniform(2.0, 40.0)) if train_task else 0.5
                if train_task and shell_rng.random() < 0.08:
                    heapq.heappush(heap, (now + dur / 2, next(seq), "fail", (c.client_id, c.task_id)))
                    continue
                upd = ClientUpdate(
                    num_samples=5 + c.client_id % 50,
                    stat_utility=float(shell_rng.uniform(0.5, 80)),
                    loss=1.0,
                    duration=round(dur, 2),
                    delta=shell_rng.standard_normal(DIM).astype(np.float32) if train_task else None,
                )
                heapq.heappush(heap, (now + dur, next(seq), "done", (c.client_id, c.task_id, upd)))
            elif isinstance(c, NewModelVersion):
                log["states"].append([c.version, _selector_state(orch.selector)])

    for i, cid in enumerate(ids):
        tier0 = schedule[cid][0][1]
        emit(orch.handle(ClientRegistered(0.0, cid, 3 + (i * 37) % 200, tier0)), 0.0)
        for when, tier in schedule[cid][1:]:
            heapq.heappush(heap, (when, next(seq), "tier", (cid, tier)))
    handled = 0
    while heap:
        t, _, kind, args = heapq.heappop(heap)
        wake = orch.next_wakeup()
        if wake is not None and wake < t:
            heapq.heappush(heap, (t, next(seq), kind, args))
            t, kind, args = wake, "tick", ()
        if t > HORIZON:
            break
        if hook is not None:
            orch = hook(orch, handled)
        handled += 1
        if kind == "tier":
            emit(orch.handle(TierChanged(t, *args)), t)
        elif kind == "done":
            emit(orch.handle(TaskFinished(t, *args)), t)
        elif kind == "fail":
            emit(orch.handle(TaskFailed(t, *args, "dropped")), t)
        else:
            emit(orch.handle(Tick(t)), t)
    log["version"] = orch.version
    log["train_dispatched"] = orch.stats.train_dispatched
    log["eval_dispatched"] = orch.stats.eval_dispatched
    return log


def record_all() -> dict[str, Any]:
    return {f"{name}/{seed}": run_scenario(name, seed) for name in SCENARIOS for seed in SEEDS}


if __name__ == "__main__":
    json.dump(record_all(), sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
