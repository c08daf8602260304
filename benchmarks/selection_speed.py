"""Selection cost at population scale: one Oort decision, and one async freed slot.

The orchestrator is built as the ``felix`` preset builds it (TierSelect: Oort with the FeLiX
authors' settings plus the eval path, TierTrack knowledge, async, concurrency 30, agg goal 10)
and filled directly with ``registered`` client records, ``available`` of them in AVL_TRAIN and
the rest UN_AVL; half of each group has a measured utility, staleness and duration, the other
half is unexplored. No model is trained: only the server's selection work is timed.

Times are wall clock (``*_ms_*``) and this thread's CPU time (``*_cpu_ms_*``, which leaves out
the time the process waits for a core on a loaded machine). ``measure_selection``: one decision is what ``Orchestrator._fill`` does to pick trainers: build
the train candidates (``_train_candidates``) and ask the selector for ``k`` of them (30, the
async concurrency). Nothing is dispatched, so every repeat sees the same population.

``measure_async_slot``: the cost of one freed slot in async mode: a ``TaskFinished`` event goes
through ``Orchestrator.handle`` (validation, Oort feedback, buffering, an aggregation every 10
updates, and the refill: train selection of the one freed slot plus the eval path). Only the
completions of training tasks are timed; eval completions are delivered between them.

``measure_tier_events`` (with ``--async-events``): after the async events, every training slot
is taken; the cost of one ``TierChanged`` event through ``Orchestrator.handle`` then (a random
client flips between AVL_TRAIN and UN_AVL; the eval budget runs out after a few probes, no new
task completes). It must not grow with the registered population.

Only the orchestrator's event API and ``ClientMap.add`` are used (plus the two private methods
above), so the same script times older checkouts: ``PYTHONPATH=/path/to/src``.

    python benchmarks/selection_speed.py 1000000 10000 --json
    python benchmarks/selection_speed.py 100000 10000 --async-events 200 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import felix
from felix.core.client_map import ClientRecord
from felix.core.commands import DispatchEval, DispatchTrain
from felix.core.events import TaskFinished, Tick, TierChanged
from felix.core.orchestrator import AvailabilityName, Orchestrator, OrchestratorConfig
from felix.core.types import ClientUpdate, Tier
from felix.strategies.aggregation.fedavg import FedBuffAggregator
from felix.strategies.selection.tierselect import tierselect

DIM = 10  # model size: irrelevant to selection, kept tiny
K = 30  # trainers per decision (the felix preset's concurrency)
ROUND = 100  # the model version the population has reached


def build(registered: int, available: int, seed: int = 0, shuffled: bool = False) -> Orchestrator:
    """An async TierSelect orchestrator over a synthetic population (see the module doc).

    ``shuffled`` registers the clients in a random order (as MQTT clients arrive) instead of by
    id, so that client ids are not the ClientMap's rows.
    """
    if not 0 < available <= registered:
        raise ValueError(f"need 0 < available <= registered, got {available} / {registered}")
    rng = np.random.default_rng(seed)
    train, ev = tierselect(10, reward_cap=320)
    cfg = OrchestratorConfig(
        mode="async", agg_goal=10, concurrency=K, task_timeout_s=None, knowledge=AvailabilityName.TIERTRACK
    )
    orch = Orchestrator(
        cfg,
        np.zeros(DIM, np.float32),
        train,
        FedBuffAggregator(),
        np.random.default_rng(seed + 1),
        eval_selector=ev,
    )
    avail = np.zeros(registered, dtype=bool)
    avail[rng.choice(registered, size=available, replace=False)] = True
    explored = rng.random(registered) < 0.5
    samples = rng.integers(5, 1000, size=registered)
    util = rng.uniform(1.0, 100.0, size=registered)
    last = rng.integers(0, ROUND, size=registered)
    dur = rng.lognormal(3.0, 0.5, size=registered).round(2)
    order = rng.permutation(registered) if shuffled else range(registered)
    for c in order:
        c = int(c)
        tier = Tier.AVL_TRAIN if avail[c] else Tier.UN_AVL
        e = bool(explored[c])
        orch.clients.add(
            ClientRecord(
                client_id=c,
                num_samples=int(samples[c]),
                tier=tier,
                reported_tier=tier,
                stat_utility=float(util[c]) if e else None,
                last_utility_round=int(last[c]) if e else -1,
                last_duration=float(dur[c]) if e else None,
                times_updated=int(e),
            )
        )
    orch.round = orch.version = ROUND
    return orch


def _decision(orch: Orchestrator) -> tuple[float, float]:
    """Wall and CPU seconds of one decision (CPU time leaves out preemption on a loaded machine)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    cands = orch._train_candidates()
    orch.selector.select(cands, min(K, len(cands)), orch._ctx())
    return time.perf_counter() - t0, time.thread_time() - c0


def measure_selection(
    registered: int, available: int, repeats: int = 50, shuffled: bool = False
) -> dict[str, Any]:
    """Median / min wall time of one train-selection decision (ms); see the module doc."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    t0 = time.perf_counter()
    orch = build(registered, available, shuffled=shuffled)
    setup_s = time.perf_counter() - t0
    _decision(orch)  # warm-up: the first decision also folds the candidates into the selector
    wall, cpu = zip(*(_decision(orch) for _ in range(repeats)), strict=True)
    return {
        "registered": registered,
        "available": available,
        "k": K,
        "repeats": repeats,
        "shuffled": shuffled,
        "selection_ms_median": 1e3 * statistics.median(wall),
        "selection_ms_min": 1e3 * min(wall),
        "selection_cpu_ms_median": 1e3 * statistics.median(cpu),
        "selection_cpu_ms_min": 1e3 * min(cpu),
        "setup_s": round(setup_s, 2),
        "felix_src": felix.__file__,
    }


def measure_async_slot(
    registered: int, available: int, events: int = 200, shuffled: bool = False
) -> dict[str, Any]:
    """Median / min wall time (ms) of ``Orchestrator.handle`` for one finished training task (async)."""
    if events < 1:
        raise ValueError(f"events must be >= 1, not {events}")
    orch = build(registered, available, shuffled=shuffled)
    rng = np.random.default_rng(7)
    pending: list[tuple[int, int, bool]] = []  # (client, task, is_train), oldest first

    def note(cmds: list[Any]) -> None:
        for c in cmds:
            if isinstance(c, (DispatchTrain, DispatchEval)):
                pending.append((c.client_id, c.task_id, isinstance(c, DispatchTrain)))

    now = 0.0
    note(orch.handle(Tick(now)))
    ms: list[float] = []
    cpu: list[float] = []
    while len(ms) < events:
        cid, tid, train = pending.pop(0)
        now += 1.0
        upd = ClientUpdate(
            num_samples=50,
            stat_utility=float(rng.uniform(1, 100)),
            loss=1.0,
            duration=float(rng.uniform(5, 60)),
            delta=rng.standard_normal(DIM).astype(np.float32) if train else None,
        )
        ev = TaskFinished(now, cid, tid, upd)
        t0, c0 = time.perf_counter(), time.thread_time()
        cmds = orch.handle(ev)
        if train:  # eval completions are delivered too, untimed: they free no training slot
            ms.append(1e3 * (time.perf_counter() - t0))
            cpu.append(1e3 * (time.thread_time() - c0))
        note(cmds)
    tier_ms = measure_tier_events(orch, rng, events, now)
    return {
        "registered": registered,
        "available": available,
        "events": events,
        "async_slot_ms_median": statistics.median(ms),
        "async_slot_ms_min": min(ms),
        "async_slot_cpu_ms_median": statistics.median(cpu),
        "tier_event_ms_median": statistics.median(tier_ms),
        "tier_event_ms_min": min(tier_ms),
        "versions": orch.version,
        "felix_src": felix.__file__,
    }


def measure_tier_events(orch: Orchestrator, rng: np.random.Generator, events: int, now: float) -> list[float]:
    """Wall ms of ``events`` tier changes through ``Orchestrator.handle`` (see the module doc)."""
    ms: list[float] = []
    n = len(orch.clients)
    for _ in range(events):
        cid = int(rng.integers(n))
        tier = Tier.UN_AVL if orch.clients[cid].tier is Tier.AVL_TRAIN else Tier.AVL_TRAIN
        now += 1.0
        t0 = time.perf_counter()
        orch.handle(TierChanged(now, cid, tier))
        ms.append(1e3 * (time.perf_counter() - t0))
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("registered", type=int)
    ap.add_argument("available", type=int)
    ap.add_argument("--repeats", type=int, default=50, help="timed decisions (after one warm-up)")
    ap.add_argument(
        "--async-events", type=int, default=0, help="also time this many async freed-slot events (0 = skip)"
    )
    ap.add_argument(
        "--shuffled-ids",
        action="store_true",
        help="register clients in a random order (ids are not rows, as under MQTT)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    try:
        out = measure_selection(args.registered, args.available, args.repeats, args.shuffled_ids)
        if args.async_events:
            a = measure_async_slot(args.registered, args.available, args.async_events, args.shuffled_ids)
            out.update(
                {
                    k: a[k]
                    for k in (
                        "events",
                        "async_slot_ms_median",
                        "async_slot_ms_min",
                        "async_slot_cpu_ms_median",
                        "tier_event_ms_median",
                        "tier_event_ms_min",
                    )
                }
            )
    except ValueError as exc:
        print(f"selection_speed: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
